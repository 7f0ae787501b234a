"""One layout of the search, evaluated from cached pieces: stage plans per (pp, stages per rank, schedule),
stage costs per (tp, AC, kind) (pp_tp.planner.stage_costs), schedule actions and bubbles per (schedule,
pp, microbatches, stages per rank), and FSDP collective counts per (schedule, rank, policy).

Per pp rank it picks the FSDP policy pair as `"auto"` does (pp_tp.planner.auto.choose: the fewest bytes
moved among those that fit, then the smallest peak) but walks the options in order of bytes moved and
stops at the first that fits: collective counts depend on the action order and the policy only, so they
are walked once and reused by every layout sharing them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pp_tp.config import JobConfig, ParallelConfig, validate
from pp_tp.config.validate import per_rank
from pp_tp.parallel.fsdp import for_pp_rank, uses_fsdp
from pp_tp.planner.auto import GIB, options
from pp_tp.planner.memory import RankMemory, rank_memory, settle, stage_policy
from pp_tp.planner.schedule_sim import bubble_fraction, schedule_actions, simulate
from pp_tp.planner.stage_costs import StageCostCache
from pp_tp.planner.walk import Walk, walk_step
from pp_tp.split.plan import StagePlan, plan_stages


@dataclass
class LayoutPlan:
    """What the search needs of one layout: plan, per-rank memory (settled) and walks, bubble."""

    pcfg: ParallelConfig  # FSDP policies resolved (per-pp-rank lists where they differ)
    microbatch: int
    plan: StagePlan
    ranks: list[RankMemory]
    walks: list[Walk]
    bubble: float

    @property
    def peak_bytes(self) -> int:
        return max(r.total_bytes for r in self.ranks)


class LayoutEvaluator:
    """Evaluates layouts of one job at one world size, sharing every cache between them."""

    def __init__(self, cfg: JobConfig, world: int, model, layout):
        self.cfg, self.world, self.model, self.layout = cfg, world, model, layout
        self.costs = StageCostCache(cfg, model, layout)
        self._plans: dict[tuple, StagePlan] = {}
        self._schedules: dict[tuple, tuple[list, float]] = {}
        self._counts: dict[tuple, Walk] = {}

    def _schedule(self, p: ParallelConfig) -> tuple[list, float]:
        key = (p.schedule, p.pp, p.microbatches, p.stages_per_rank)
        if key not in self._schedules:
            actions = schedule_actions(*key)
            self._schedules[key] = actions, max(bubble_fraction(simulate(actions)))
        return self._schedules[key]

    def _plan(self, p: ParallelConfig) -> StagePlan:
        key = (p.pp, p.stages_per_rank, p.schedule, p.split)
        if key not in self._plans:
            self._plans[key] = plan_stages(self.model, self.layout, p, self.cfg.training.seq_len)
        return self._plans[key]

    def _walk(self, rank: RankMemory, actions: list, p: ParallelConfig, pair: tuple) -> Walk:
        trial = dataclasses.replace(p, fsdp_reshard_after_forward=pair[0], fsdp_grad_reduce=pair[1])
        policy = {s: stage_policy(trial) for s in rank.stages}
        return walk_step(actions, rank.sizes, policy, p.microbatches)

    def _moved(self, rank: RankMemory, actions: list, p: ParallelConfig, pair: tuple) -> int:
        """FSDP bytes the rank moves per step under `pair` (counts walked once per schedule, rank, policy)."""
        key = (p.schedule, p.pp, p.microbatches, p.stages_per_rank, rank.pp_rank, uses_fsdp(p), pair)
        if key not in self._counts:
            self._counts[key] = self._walk(rank, actions, p, pair)
        c = self._counts[key]
        return sum(c.all_gathers[s] * z.gathered + c.reduce_scatters[s] * z.grads for s, z in rank.sizes.items())

    def _choose(self, rank: RankMemory, actions: list, p: ParallelConfig) -> tuple | None:
        """auto.choose's pick for this rank, or None when no pair fits the budget."""
        pairs = options(p, per_rank(p.fsdp_reshard_after_forward, p.pp)[rank.pp_rank],
                        per_rank(p.fsdp_grad_reduce, p.pp)[rank.pp_rank])  # fmt: skip
        ranked = sorted((self._moved(rank, actions, p, pair), i, pair) for i, pair in enumerate(pairs))
        best = None
        for moved, _, pair in ranked:
            if best is not None and moved > best[0]:
                break
            peak = rank.peak(self._walk(rank, actions, p, pair).peak)
            if peak <= p.memory_budget_gib * GIB and (best is None or peak < best[1]):
                best = (moved, peak, pair)
        return best[2] if best else None

    def evaluate(self, p: ParallelConfig) -> LayoutPlan | None:
        """The layout with "auto" FSDP policies resolved under p.memory_budget_gib; None if it does not fit."""
        p = validate(dataclasses.replace(self.cfg, parallel=p), self.world).parallel
        plan, (actions, bubble) = self._plan(p), self._schedule(p)
        microbatch = self.cfg.training.batch_size // (p.dp * p.microbatches)
        fixed = dataclasses.replace(p, fsdp_reshard_after_forward="default", fsdp_grad_reduce="step")
        ranks = []
        for r in range(p.pp):
            specs = plan.for_rank(r)
            costs = [
                self.costs.cost(p.tp, p.activation_checkpoint, (s.embed, len(s.blocks), s.head), p.dp_shard, microbatch)
                for s in specs
            ]
            ranks.append(rank_memory(r, [s.index for s in specs], costs, fixed))
        picks = []
        for rank in ranks:
            pick = self._choose(rank, actions[rank.pp_rank], p)
            if pick is None:
                return None
            picks.append(pick)
        p = _with_picks(p, picks)
        final = [
            dataclasses.replace(r, policy={s: stage_policy(for_pp_rank(p, r.pp_rank)) for s in r.stages}) for r in ranks
        ]
        walks = [walk_step(actions[r.pp_rank], r.sizes, r.policy, p.microbatches) for r in final]
        for r, w in zip(final, walks):
            settle(r, w)
        return LayoutPlan(p, microbatch, plan, final, walks, bubble)


def _with_picks(p: ParallelConfig, picks: list[tuple]) -> ParallelConfig:
    reshard, reduce = [x[0] for x in picks], [x[1] for x in picks]
    return dataclasses.replace(
        p,
        fsdp_reshard_after_forward=reshard if len(set(reshard)) > 1 else reshard[0],
        fsdp_grad_reduce=reduce if len(set(reduce)) > 1 else reduce[0],
    )
