"""The schedule as torch orders it, simulated: per-rank action lists, their timeline in cost units, the bubble.

The planner's estimates and `pp-tp plan` use it; diagnostics/timeline.py draws it next to a measured step.
Bubble fraction is idle time over compute time per rank (Narayanan et al. 2021: (p-1)/m for GPipe and 1F1B,
(p-1)/(v*m) interleaved), so measured, simulated and theoretical values compare directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
)

from pp_tp.base._torch import Action, compute_order
from pp_tp.schedules.registry import get_schedule_spec, is_csv_schedule, read_csv_schedule

# Relative compute cost of each action in the simulation: a full backward is two forwards.
ACTION_COST = {FORWARD: 1.0, BACKWARD_INPUT: 1.0, BACKWARD_WEIGHT: 1.0, FULL_BACKWARD: 2.0}


@dataclass(frozen=True)
class Span:
    """One box on the timeline. `start`/`dur` are seconds from the step start (measured) or cost units (simulated)."""

    rank: int
    name: str
    kind: str  # "compute" or "comm"
    start: float
    dur: float


# ---------------------------------------------------------------------------------------------
# The schedule as torch orders it, and its simulation


def _looped_order(pp: int, microbatches: int, warmup: Callable[[int], int]) -> dict[int, list[Action]]:
    """What torch's GPipe and 1F1B loops run on stage s: `warmup(s)` forwards, then B/F pairs, then the Bs."""
    order = {}
    for s in range(pp):
        fwd = [Action(s, FORWARD, i) for i in range(microbatches)]
        bwd = [Action(s, FULL_BACKWARD, i) for i in range(microbatches)]
        w = warmup(s)
        order[s] = fwd[:w] + [a for pair in zip(bwd, fwd[w:]) for a in pair] + bwd[microbatches - w :]
    return order


def schedule_actions(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> list[list[Action]]:
    """The compute actions of every pp rank in the order torch runs them.

    GPipe and 1F1B run hand-written loops in torch (their `pipeline_order` is only a picture, and for
    1F1B's last rank it is off by one microbatch in torch 2.13), so their order is read off those loops.
    Other schedules run their `pipeline_order`, built here from mock stages (no process group needed;
    unlike torch's `get_schedule_ops` this also takes one stage per rank), or a CSV's rows.
    """
    if schedule == "GPipe":
        order = _looped_order(pp, microbatches, lambda s: microbatches)
    elif schedule == "1F1B":
        order = _looped_order(pp, microbatches, lambda s: min(microbatches, pp - s))
    elif is_csv_schedule(schedule):
        order = read_csv_schedule(schedule)
    else:
        spec = get_schedule_spec(schedule)
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.submod = 0, pp, None
        stage.num_stages = pp * stages_per_rank
        order = compute_order(spec.cls, [stage] * stages_per_rank if spec.multi_stage else stage, microbatches)
    return [[a for a in order[r] if a is not None and a.is_compute_op] for r in range(pp)]


def _leaves(action: Action) -> tuple[Action, ...]:
    return action.sub_actions if action.computation_type == OVERLAP_F_B else (action,)


def simulate(
    actions: list[list[Action]], cost: Callable[[Action], float] = lambda a: ACTION_COST[a.computation_type]
) -> list[Span]:
    """Start and end of every action when each rank runs its list in order as soon as its inputs exist.

    Home-made: torch's `_simulate_comms_compute` has no durations and its visualizer's
    `add_schedule_op_spacing` stalls on 1F1B in torch 2.13. F(s) waits for F(s-1); B or I(s) for
    B or I(s+1) (the last stage for its own F); W for its I. p2p is free.
    """
    num_stages = 1 + max(leaf.stage_index for acts in actions for a in acts for leaf in _leaves(a))
    done: dict[tuple[int, Any, int], float] = {}

    def ready(a: Action) -> float | None:
        s, kind, mb = a.stage_index, a.computation_type, a.microbatch_index
        if kind == FORWARD:
            deps = [] if s == 0 else [[(s - 1, FORWARD, mb)]]
        elif kind == BACKWARD_WEIGHT:
            deps = [[(s, BACKWARD_INPUT, mb)]]
        elif s == num_stages - 1:
            deps = [[(s, FORWARD, mb)]]
        else:  # one of the two ways the next stage produces this stage's output gradient
            deps = [[(s + 1, FULL_BACKWARD, mb), (s + 1, BACKWARD_INPUT, mb)]]
        times = []
        for options in deps:
            found = [done[k] for k in options if k in done]
            if not found:
                return None
            times.append(min(found))
        return max(times, default=0.0)

    spans: list[Span] = []
    free = [0.0] * len(actions)
    pos = [0] * len(actions)
    while any(pos[r] < len(acts) for r, acts in enumerate(actions)):
        progressed = False
        for r, acts in enumerate(actions):
            while pos[r] < len(acts):
                leaves = _leaves(acts[pos[r]])
                starts = [ready(leaf) for leaf in leaves]
                if any(t is None for t in starts):
                    break
                t = max([free[r], *starts])
                for leaf in leaves:
                    spans.append(Span(r, str(leaf), "compute", t, cost(leaf)))
                    t += cost(leaf)
                    done[(leaf.stage_index, leaf.computation_type, leaf.microbatch_index)] = t
                free[r], pos[r], progressed = t, pos[r] + 1, True
        if not progressed:
            stuck = {r: str(acts[pos[r]]) for r, acts in enumerate(actions) if pos[r] < len(acts)}
            raise ValueError(f"schedule does not progress; next actions per rank: {stuck}")
    return spans


def bubble_fraction(spans: list[Span], makespan: float | None = None) -> list[float]:
    """Idle over compute time per rank, the step lasting `makespan` (default: the last span's end)."""
    end = makespan if makespan is not None else max(s.start + s.dur for s in spans)
    ranks = sorted({s.rank for s in spans})
    busy = {r: sum(s.dur for s in spans if s.rank == r and s.kind == "compute") for r in ranks}
    return [(end - busy[r]) / busy[r] for r in ranks]


def theoretical_bubble(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float | None:
    """Narayanan et al.: (p-1)/m for GPipe and 1F1B, (p-1)/(v*m) for Interleaved1F1B; None for the rest."""
    if schedule in ("GPipe", "1F1B"):
        return (pp - 1) / microbatches
    if schedule == "Interleaved1F1B":
        return (pp - 1) / (stages_per_rank * microbatches)
    return None
