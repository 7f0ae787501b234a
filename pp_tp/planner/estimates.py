"""Schedule estimates: bubble (theory and simulated) and activation peak of each candidate schedule."""

from __future__ import annotations

from dataclasses import dataclass

from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.planner.memory import RankMemory, peak_held_bytes
from pp_tp.planner.schedule_sim import bubble_fraction, schedule_actions, simulate, theoretical_bubble
from pp_tp.planner.walk import Walk, walk_step
from pp_tp.schedules.registry import check_schedule, get_schedule_spec, is_csv_schedule

# Schedules compared against the configured one, by stage->rank mapping and stages per rank.
_SINGLE_STAGE = ("GPipe", "1F1B")
_LOOPED_MULTI = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")


@dataclass
class ScheduleEstimate:
    """One schedule's bubble and activation peak on the planned job."""

    name: str
    bubble_theory: float | None
    bubble_simulated: float
    act_peak_bytes: list[int]  # per pp rank
    peak_microbatches: list[float]  # per pp rank: peak held / one microbatch through all of the rank's stages
    walks: list[Walk]  # per pp rank: the step walked under the rank's FSDP policy

    def peak_bytes(self, ranks: list[RankMemory]) -> list[int]:
        """Per pp rank: everything held at the rank's peak under this schedule."""
        return [r.peak(w.peak) for r, w in zip(ranks, self.walks)]


def candidate_schedules(pcfg: ParallelConfig) -> list[str]:
    """The configured schedule and the built-in ones that run the same stages on the same ranks."""
    names = [pcfg.schedule]
    if not is_csv_schedule(pcfg.schedule) and get_schedule_spec(pcfg.schedule).mapping == "loop":
        names += _SINGLE_STAGE if pcfg.stages_per_rank == 1 else _LOOPED_MULTI
    out = []
    for name in dict.fromkeys(names):
        try:
            check_schedule(pcfg.pp, pcfg.stages_per_rank, pcfg.microbatches, name)
        except ConfigError:
            continue
        out.append(name)
    return out


def schedule_estimate(name: str, pcfg: ParallelConfig, ranks: list[RankMemory]) -> ScheduleEstimate:
    """Bubble and per-rank activation peak of schedule `name`, from its own action order."""
    actions = schedule_actions(name, pcfg.pp, pcfg.microbatches, pcfg.stages_per_rank)
    peaks = [peak_held_bytes(actions[r.pp_rank], r.act_bytes_per_microbatch) for r in ranks]
    walks = [walk_step(actions[r.pp_rank], r.sizes, r.policy, pcfg.microbatches) for r in ranks]
    per_mb = [sum(r.act_bytes_per_microbatch.values()) for r in ranks]
    return ScheduleEstimate(
        name,
        theoretical_bubble(name, pcfg.pp, pcfg.microbatches, pcfg.stages_per_rank),
        max(bubble_fraction(simulate(actions))),
        peaks,
        [p / b if b else 0.0 for p, b in zip(peaks, per_mb)],
        walks,
    )
