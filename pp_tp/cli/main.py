"""`pp-tp` command line. Each subcommand is one `_add_<name>` (its arguments) and one `_<name>` (its work).

Bad input ends as one `error: ...` line on stderr and exit code 2, never a traceback, and before any
process group is started: every subcommand runs `pp_tp.cli.job.check_job` first.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from pp_tp.cli import export, launch, parity, train
from pp_tp.cli.job import add_job_args, check_job, load_job
from pp_tp.config import format_config, load_config
from pp_tp.errors import ConfigError
from pp_tp.planner import resolve_auto
from pp_tp.planner.cli import add_plan_args, run_plan, world_note

EXIT_BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pp-tp` console script; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


def build_parser() -> argparse.ArgumentParser:
    """The parser with every subcommand registered; a new subcommand adds its `_add_<name>` below."""
    parser = argparse.ArgumentParser(prog="pp-tp", description="Pipeline- and tensor-parallel Transformer training.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    for add in (_add_check, _add_parity, _add_train, _add_plan, _add_export):
        add(commands)
    return parser


def _add_check(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "check", help="validate a job (config and model) and print it resolved; starts nothing"
    )
    add_job_args(parser)
    parser.set_defaults(run=_check)


def _check(args: argparse.Namespace) -> int:
    cfg, _ = check_job(load_job(args), args.world_size)
    print(format_config(cfg), end="")
    return 0


def run_ranks(args: argparse.Namespace, module: str, per_rank_main: Callable[[list[str]], int], data: bool) -> int:
    """Runs a per-rank entry: here under torchrun, or on `--nproc` local ranks spawned through torchrun.

    With `--nproc` the whole job is checked against that world size before anything is spawned, so a
    bad config never starts a process group; under torchrun each rank checks it itself.
    """
    if args.nproc:
        cfg, _ = check_job(load_config(args.config, args.overrides, args.nproc), args.nproc, data)
        resolve_auto(cfg, args.nproc)  # "auto" that no policy fits fails here, before anything spawns
        return launch.run_under_torchrun(args.nproc, module, _without_nproc(args.argv[1:]))
    if "RANK" not in os.environ:
        raise ConfigError(f"pp-tp {args.command}: not under torchrun; pass --nproc N to spawn N local ranks")
    return per_rank_main(_without_nproc(args.argv[1:]))


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def _add_ranked(
    commands: argparse._SubParsersAction,
    name: str,
    help: str,
    add_args: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> None:
    """A subcommand that runs on ranks: its own arguments plus `--nproc`."""
    parser = commands.add_parser(name, help=help)
    add_args(parser)
    parser.add_argument("--nproc", type=int, default=None, help="spawn this many local ranks")
    parser.set_defaults(run=run)


def _add_parity(commands: argparse._SubParsersAction) -> None:
    _add_ranked(
        commands,
        "parity",
        "compare the job's pipelined build with its non-PP build",
        parity.add_parity_args,
        lambda args: run_ranks(parity.float64_overrides(args), "pp_tp.cli.parity", parity.main, data=False),
    )


def _add_train(commands: argparse._SubParsersAction) -> None:
    _add_ranked(
        commands,
        "train",
        "train the job (under torchrun, or on --nproc local ranks)",
        add_job_args,
        lambda args: run_ranks(args, "pp_tp.cli.train", train.main, data=True),
    )


def _add_plan(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan",
        help="dry-run the job at --world-size ranks in this process (meta device, "
        "fake process group): stages, mesh, memory per rank, bubble",
    )
    add_job_args(parser)
    add_plan_args(parser)
    parser.set_defaults(run=_plan)


def _plan(args: argparse.Namespace) -> int:
    """Without --world-size the plan runs at the degrees' product, and says so (a refusal names it too)."""
    cfg = load_job(args)
    note = world_note(args, cfg)
    try:
        cfg, _ = check_job(cfg, args.world_size)
        return run_plan(args, cfg, cfg.parallel.world_size, note)
    except ConfigError as e:
        raise ConfigError(f"{e} ({note})" if note else str(e)) from None


def _add_export(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "export", help="write the run's DCP checkpoint (latest, or --step N) as a Hugging Face model directory"
    )
    export.add_export_args(parser)
    parser.add_argument("--nproc", type=int, default=None, help="spawn this many local ranks (default: 1 process)")
    parser.set_defaults(run=_export)


def _export(args: argparse.Namespace) -> int:
    """One process here unless --nproc N (through torchrun) or already under torchrun."""
    if args.nproc:
        return launch.run_under_torchrun(args.nproc, "pp_tp.cli.export", _without_nproc(args.argv[1:]))
    return export.main(args.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
