"""One layout of the search, evaluated from cached pieces: stage plans per (pp, stages per rank, schedule),
stage costs per (tp, AC, ep, cp, kind) (pp_tp.planner.stage_costs), schedule actions and bubbles per (schedule,
pp, microbatches, stages per rank), and FSDP collective counts per (schedule, rank, policy).

Per pp rank it picks the FSDP policy pair with `"auto"`'s own rule (pp_tp.planner.auto.choose), handing it
collective counts from a cache: they depend on the action order and the policy only, so they are walked once
and reused by every layout sharing them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from pp_tp.config import JobConfig, ParallelConfig, validate
from pp_tp.config.fsdp_policy import FsdpPolicy
from pp_tp.errors import ConfigError
from pp_tp.planner.auto import choose, with_picks
from pp_tp.planner.memory import RankMemory, rank_memory, settle
from pp_tp.planner.moe import block_signatures, stage_kind
from pp_tp.planner.schedule_sim import bubble_fraction, schedule_actions, simulate
from pp_tp.planner.stage_costs import StageCostCache
from pp_tp.planner.walk import Walk, walk_step
from pp_tp.split.plan import StagePlan, plan_stages


@dataclass(frozen=True)
class Outline:
    """What a layout is before any stage is measured: its validated [parallel], stage plan, schedule actions,
    simulated bubble and microbatch (enough for the search's step-time lower bound)."""

    pcfg: ParallelConfig
    plan: StagePlan
    actions: list
    bubble: float
    microbatch: int


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
        self.signatures = block_signatures(model, layout)
        self._plans: dict[tuple, StagePlan] = {}
        self._schedules: dict[tuple, tuple[list, float]] = {}
        self._count_walks: dict[tuple, Walk] = {}
        self._walks: dict[tuple, dict[FsdpPolicy, Walk]] = {}

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

    def _counts(self, rank: RankMemory, actions: list, p: ParallelConfig) -> Callable[[FsdpPolicy], Walk]:
        """The rank's collective counts per policy, walked once per (schedule, rank, policy)."""
        where = (p.schedule, p.pp, p.microbatches, p.stages_per_rank, rank.pp_rank)

        def counts(policy: FsdpPolicy) -> Walk:
            key = (*where, policy)
            if key not in self._count_walks:
                self._count_walks[key] = walk_step(actions, rank.sizes, policy, p.microbatches)
            return self._count_walks[key]

        return counts

    def _walked(self, rank: RankMemory, p: ParallelConfig) -> dict[FsdpPolicy, Walk]:
        """The rank's walks per policy, kept across layouts with the same actions and stage sizes (those that
        differ only in how dp splits into dp_replicate x dp_shard: the walk's sizes are DP-gathered)."""
        key = (p.schedule, p.pp, p.microbatches, p.stages_per_rank, rank.pp_rank, tuple(rank.sizes.items()))
        return self._walks.setdefault(key, {})

    def outline(self, p: ParallelConfig) -> Outline:
        """The layout validated and planned, nothing measured; ConfigError when the config rules refuse it."""
        p = validate(dataclasses.replace(self.cfg, parallel=p), self.world).parallel
        plan, (actions, bubble) = self._plan(p), self._schedule(p)
        return Outline(p, plan, actions, bubble, self.cfg.training.batch_size // (p.dp * p.microbatches))

    def evaluate(self, p: ParallelConfig) -> LayoutPlan | None:
        """The layout with "auto" FSDP policies resolved under p.memory_budget_gib; None if it does not fit."""
        return self.fit(self.outline(p))

    def _beyond(self, r: int, specs: list, kinds: list, actions: list, p: ParallelConfig, microbatch: int) -> bool:
        """True when no policy fits pp rank `r` even at its stages' cost floors (StageCostCache.floor), so its
        own AC need not be measured: the walk's peak only grows with each stage's activations and transient."""
        try:
            floors = [
                self.costs.floor(p.tp, p.activation_checkpoint, p.ep, p.cp, k, p.dp_shard, microbatch) for k in kinds
            ]
        except ConfigError:
            return False  # full AC refused here: no floor, measure the layout's own AC
        rank = rank_memory(r, [s.index for s in specs], floors, p)
        return choose(rank, actions, p, self._counts(rank, actions, p), self._walked(rank, p)) is None

    def fit(self, o: Outline) -> LayoutPlan | None:
        """`evaluate` of an outlined layout: per pp rank its stages measured (cached) and its policy picked; the
        first rank that no policy fits ends it, before later ranks' stage kinds are measured; under AC "none" or
        "selective" so does any rank that no policy fits at its cost floor, before any stage is measured at that AC."""
        p, plan, actions, microbatch = o.pcfg, o.plan, o.actions, o.microbatch
        ranks, picks, walked = [], [], []
        kinds = [[stage_kind(s, self.signatures) for s in plan.for_rank(r)] for r in range(p.pp)]
        if p.activation_checkpoint != "full" and any(
            self._beyond(r, plan.for_rank(r), kinds[r], actions[r], p, microbatch) for r in range(p.pp)
        ):  # every rank's floor before any rank's own AC is measured
            return None
        for r in range(p.pp):
            specs = plan.for_rank(r)
            costs = [
                self.costs.cost(p.tp, p.activation_checkpoint, p.ep, p.cp, k, p.dp_shard, microbatch) for k in kinds[r]
            ]
            rank = rank_memory(r, [s.index for s in specs], costs, p)
            seen = self._walked(rank, p)
            pick = choose(rank, actions[r], p, self._counts(rank, actions[r], p), seen)
            if pick is None:
                return None
            ranks.append(rank)
            picks.append(pick)
            walked.append(seen)
        p = with_picks(p, picks)
        final = [dataclasses.replace(r, policy=FsdpPolicy.for_rank(p, r.pp_rank)) for r in ranks]
        walks = [
            seen.get(r.policy) or walk_step(actions[r.pp_rank], r.sizes, r.policy, p.microbatches)
            for r, seen in zip(final, walked)
        ]
        for r, w in zip(final, walks):
            settle(r, w)
        return LayoutPlan(p, microbatch, plan, final, walks, o.bubble)
