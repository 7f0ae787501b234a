"""`python -m pp_tp.cli.train --config F [section.key=value ...]`: the per-rank training entry torchrun starts.

One node or many (docs/multinode.md); `pp-tp train --nproc N` starts N local ranks of it through torchrun.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch.distributed as dist

from pp_tp.cli.job import add_job_args, load_job
from pp_tp.errors import ConfigError
from pp_tp.train.nonfinite import NonFiniteError
from pp_tp.train.trainer import train

EXIT_BAD_INPUT, EXIT_NONFINITE = 2, 3


def main(argv: list[str] | None = None, before_step: Callable[[int], None] | None = None) -> int:
    """Per-rank entry under torchrun; the world size comes from torchrun's environment."""
    parser = argparse.ArgumentParser(prog="python -m pp_tp.cli.train", description=__doc__.splitlines()[0])
    add_job_args(parser)
    args = parser.parse_args(argv)
    try:
        train(load_job(args), before_step)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except NonFiniteError as e:  # the same line on every rank; torchrun reports the failed ranks
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    raise SystemExit(record(main)())
