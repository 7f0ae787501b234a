"""Schedule names -> torch.distributed.pipelining classes, each with its constraints.

The constraints are checked on the config alone, before any process group exists, so a bad
combination ends with one line naming the key and the fix instead of a hang or a torch assert.
"""

from __future__ import annotations

import csv
import difflib
import os
from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed import pipelining as pl

from pp_tp.base._torch import Action
from pp_tp.errors import ConfigError


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule: its torch class and what it needs from `[parallel]`.

    ``stages_per_rank``: a fixed count, or None for any count >= ``min_stages_per_rank``.
    ``mapping``: "loop" (stage s on rank s % pp) or "v" (rank r owns r and 2*pp-1-r).
    ``check_microbatches(pp, num_stages, m)`` returns an error text, or None when m is fine.
    ``splits_weight_grad``: runs weight gradients (W) apart from input gradients (B), as zero-bubble
    schedules do; with FSDP resharding between them, torch 2.13 leaves some gradients unset.
    """

    name: str
    cls: type
    multi_stage: bool
    mapping: str = "loop"
    stages_per_rank: int | None = None
    min_stages_per_rank: int = 1
    check_microbatches: Callable[[int, int, int], str | None] = lambda pp, s, m: None
    splits_weight_grad: bool = False


def _at_least_stages(pp: int, num_stages: int, m: int) -> str | None:
    return None if m >= num_stages else f"needs microbatches >= number of stages ({num_stages})"


def _at_least_pp(pp: int, num_stages: int, m: int) -> str | None:
    return None if m >= pp else f"needs microbatches >= pp ({pp})"


def _rounds(pp: int, num_stages: int, m: int) -> str | None:
    # torch runs interleaved schedules in rounds of max(1, m // pp) microbatches.
    if m < pp:
        return f"needs microbatches >= pp ({pp})"
    rounds = max(1, m // pp)
    return None if m % rounds == 0 else f"needs microbatches to be a multiple of pp ({pp})"


_REGISTRY: dict[str, ScheduleSpec] = {}


def register_schedule(spec: ScheduleSpec) -> None:
    """Adds a schedule by name; third-party packages call this from a `pp_tp.schedules` entry point."""
    _REGISTRY[spec.name] = spec


for _spec in (
    ScheduleSpec("GPipe", pl.ScheduleGPipe, multi_stage=False, stages_per_rank=1),
    ScheduleSpec("1F1B", pl.Schedule1F1B, multi_stage=False, stages_per_rank=1, check_microbatches=_at_least_stages),
    ScheduleSpec("Interleaved1F1B", pl.ScheduleInterleaved1F1B, multi_stage=True, check_microbatches=_rounds),
    ScheduleSpec("LoopedBFS", pl.ScheduleLoopedBFS, multi_stage=True, check_microbatches=_at_least_pp),
    ScheduleSpec(
        "InterleavedZeroBubble",
        pl.ScheduleInterleavedZeroBubble,
        multi_stage=True,
        check_microbatches=_rounds,
        splits_weight_grad=True,
    ),
    ScheduleSpec(
        "ZBVZeroBubble",
        pl.ScheduleZBVZeroBubble,
        multi_stage=True,
        mapping="v",
        stages_per_rank=2,
        check_microbatches=_at_least_stages,
        splits_weight_grad=True,
    ),
    ScheduleSpec(
        "DualPipeV",
        pl.ScheduleDualPipeV,
        multi_stage=True,
        mapping="v",
        stages_per_rank=2,
        check_microbatches=_at_least_stages,
        splits_weight_grad=True,
    ),
):
    register_schedule(_spec)


def schedule_names() -> list[str]:
    return sorted(_REGISTRY)


def is_csv_schedule(name: str) -> bool:
    return name.lower().endswith(".csv")


def read_csv_schedule(path: str) -> dict[int, list]:
    """Parses a torch action CSV (one row per pp rank, e.g. ``0F0,1F0,...``) into actions per rank."""
    if not os.path.isfile(path):
        raise ConfigError(f"parallel.schedule = {path!r}: file not found; give an existing CSV path or a schedule name")
    with open(path, newline="") as f:
        rows = [row for row in csv.reader(f) if row]
    try:
        return {rank: [Action.from_str(a.strip()) for a in row if a.strip()] for rank, row in enumerate(rows)}
    except (RuntimeError, ValueError) as e:
        raise ConfigError(
            f"parallel.schedule = {path!r}: bad action ({e}); use torch's action format like 0F0,0B0"
        ) from None


def csv_stage_to_rank(actions: dict[int, list]) -> dict[int, int]:
    """Which rank runs each stage, read off the compute actions of a CSV schedule."""
    owner: dict[int, int] = {}
    for rank, acts in actions.items():
        for a in acts:
            if a is not None and owner.setdefault(a.stage_index, rank) != rank:
                raise ConfigError(
                    f"schedule CSV: stage {a.stage_index} appears on ranks {owner[a.stage_index]} and {rank}; "
                    "each stage must run on one rank"
                )
    return owner


def get_schedule_spec(name: str) -> ScheduleSpec:
    names = schedule_names()
    if name not in _REGISTRY:
        same_case = [n for n in names if n.lower() == name.lower()]
        close = same_case or difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"parallel.schedule = {name!r} is unknown{hint}; use one of {', '.join(names)} or a .csv path"
        )
    return _REGISTRY[name]


def default_stages_per_rank(schedule: str, pp: int) -> int:
    """stages_per_rank when the config leaves it out: a CSV's own count, a schedule's fixed count (2 for V
    schedules), else 2 for other multi-stage schedules and 1 for single-stage ones (as torchtitan infers it)."""
    if is_csv_schedule(schedule):
        return max(1, len(csv_stage_to_rank(read_csv_schedule(schedule))) // max(pp, 1))
    spec = get_schedule_spec(schedule)
    return spec.stages_per_rank or (2 if spec.multi_stage else 1)


def check_schedule(
    pp: int, stages_per_rank: int, microbatches: int, schedule: str, reshard: str | int = "default"
) -> None:
    """Refuses a schedule / stages_per_rank / microbatches combination torch would reject or hang on."""
    if is_csv_schedule(schedule):
        owner = csv_stage_to_rank(read_csv_schedule(schedule))
        ranks = sorted(set(owner.values()))
        if len(owner) != pp * stages_per_rank or ranks != list(range(pp)):
            per_rank = max(1, len(owner) // max(1, len(ranks)))
            raise ConfigError(
                f"parallel.schedule = {schedule!r} runs {len(owner)} stages on {len(ranks)} ranks; "
                f"set parallel.pp = {len(ranks)} and parallel.stages_per_rank = {per_rank}"
            )
        return
    spec = get_schedule_spec(schedule)
    if spec.stages_per_rank is not None and stages_per_rank != spec.stages_per_rank:
        raise ConfigError(
            f"parallel.stages_per_rank = {stages_per_rank}: schedule {schedule} needs exactly "
            f"{spec.stages_per_rank}; set parallel.stages_per_rank = {spec.stages_per_rank}"
        )
    if stages_per_rank < spec.min_stages_per_rank:
        raise ConfigError(
            f"parallel.stages_per_rank = {stages_per_rank}: schedule {schedule} needs at least "
            f"{spec.min_stages_per_rank}"
        )
    if spec.splits_weight_grad and reshard not in ("default", "never"):
        raise ConfigError(
            f"parallel.fsdp_reshard_after_forward = {reshard!r}: schedule {schedule} computes weight "
            "gradients after input gradients and torch leaves some unset when FSDP reshards between "
            'them; use "default" or "never", or a schedule without split backward (e.g. Interleaved1F1B)'
        )
    problem = spec.check_microbatches(pp, pp * stages_per_rank, microbatches)
    if problem:
        raise ConfigError(
            f"parallel.microbatches = {microbatches}: schedule {schedule} {problem}; raise parallel.microbatches"
        )


def stage_owner(pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """The pp rank of every stage under this schedule's mapping."""
    n = pp * stages_per_rank
    if is_csv_schedule(schedule):
        owner = csv_stage_to_rank(read_csv_schedule(schedule))
        return [owner[s] for s in range(n)]
    if get_schedule_spec(schedule).mapping == "v":
        return [s if s < pp else 2 * pp - 1 - s for s in range(n)]
    return [s % pp for s in range(n)]
