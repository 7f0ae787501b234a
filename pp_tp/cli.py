"""`pp-tp` command line. Each subcommand is one `_add_<name>` (its arguments) and one `_<name>` (its work).

Bad input ends as one `error: ...` line on stderr and exit code 2, never a traceback, and before any
process group is started.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from pp_tp.config import JobConfig, format_config, load_config
from pp_tp.errors import ConfigError

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
    for add in (_add_check, _add_parity, _add_train, _add_plan):
        add(commands)
    return parser


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """--config, --world-size and trailing `section.key=value` overrides: every subcommand that reads a job."""
    parser.add_argument("--config", required=True, help="TOML job file")
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of ranks to check against (default: $WORLD_SIZE, else the product of the degrees)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override a TOML value, e.g. parallel.tp=2 parallel.schedule=GPipe")


def load_job(args: argparse.Namespace) -> JobConfig:
    """The validated job named by `add_config_args`' arguments."""
    return load_config(args.config, args.overrides, args.world_size)


def _add_check(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("check", help="validate a job config and print it resolved; starts nothing")
    add_config_args(parser)
    parser.set_defaults(run=_check)


def _check(args: argparse.Namespace) -> int:
    print(format_config(load_job(args)), end="")
    return 0


def run_ranks(args: argparse.Namespace, module: str, per_rank_main: Callable[[list[str]], int],
              check: Callable[[JobConfig], None] | None = None) -> int:
    """Runs a per-rank entry: here under torchrun, or on `--nproc` local ranks spawned through torchrun.

    With `--nproc` the job is validated against that world size (and by `check`) before anything is
    spawned, so a bad config never starts a process group; under torchrun each rank validates it itself.
    """
    if args.nproc:
        cfg = load_config(args.config, args.overrides, args.nproc)
        if check is not None:
            check(cfg)
        from pp_tp.launch import run_under_torchrun

        return run_under_torchrun(args.nproc, module, _without_nproc(args.argv[1:]))
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


def _add_ranked(commands: argparse._SubParsersAction, name: str, help: str,
                add_args: Callable[[argparse.ArgumentParser], None],
                run: Callable[[argparse.Namespace], int]) -> None:
    """A subcommand that runs on ranks: its own arguments plus `--nproc`."""
    parser = commands.add_parser(name, help=help)
    add_args(parser)
    parser.add_argument("--nproc", type=int, default=None, help="spawn this many local ranks")
    parser.set_defaults(run=run)


def _add_parity(commands: argparse._SubParsersAction) -> None:
    from pp_tp.parity import add_parity_args

    _add_ranked(commands, "parity", "compare the job's pipelined build with its non-PP build", add_parity_args,
                _parity)


def _parity(args: argparse.Namespace) -> int:
    from pp_tp import parity

    return run_ranks(args, "pp_tp.parity", parity.main)


def _add_train(commands: argparse._SubParsersAction) -> None:
    from pp_tp.trainer import add_train_args

    _add_ranked(commands, "train", "train the job (under torchrun, or on --nproc local ranks)", add_train_args,
                _train)


def _train(args: argparse.Namespace) -> int:
    from pp_tp import trainer

    return run_ranks(args, "pp_tp.trainer", trainer.main, check=trainer.check_job)


def _add_plan(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("plan", help="dry-run the job at --world-size ranks in this process (meta device, "
                                              "fake process group): stages, mesh, memory per rank, bubble")
    add_config_args(parser)
    parser.set_defaults(run=_plan)


def _plan(args: argparse.Namespace) -> int:
    from pp_tp.planner import format_plan, plan_job

    cfg = load_job(args)
    p = cfg.parallel
    print(format_plan(plan_job(cfg, p.pp * p.dp_replicate * p.dp_shard * p.tp)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
