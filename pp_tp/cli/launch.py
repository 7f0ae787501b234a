"""Spawning ranks on one machine for `--nproc N`: torchrun's own launcher, called in-process."""

from __future__ import annotations

import sys

from pp_tp.errors import ConfigError


def run_under_torchrun(nproc: int, module: str, argv: list[str], max_restarts: int = 0) -> int:
    """Runs `python -m module argv...` on `nproc` local ranks via torch.distributed.run; returns an exit code.

    A rank that fails makes torchrun stop the others and report the failing rank, so nothing hangs.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if nproc < 1:
        raise ConfigError(f"--nproc = {nproc}: needs at least 1 process")
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "--module", module, *argv]
    )
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(f"error: rank {rank} exited with code {failure.exitcode}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0
