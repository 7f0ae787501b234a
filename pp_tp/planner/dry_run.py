"""The dry run: the real mesh, stage plan and parallelization passes on meta, in the fake world."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from pp_tp.base._torch import FakeTensorMode
from pp_tp.config import JobConfig, ParallelConfig, validate
from pp_tp.config.fsdp_policy import FsdpPolicy
from pp_tp.errors import ConfigError
from pp_tp.layout import ModelDims, layout_for
from pp_tp.models.factory import build_model
from pp_tp.parallel.mesh import MESH_DIMS, make_mesh, mesh_shape
from pp_tp.planner.auto import resolve_policies
from pp_tp.planner.estimates import ScheduleEstimate, candidate_schedules, schedule_estimate
from pp_tp.planner.fake_world import fake_world
from pp_tp.planner.memory import RankMemory, StageCost, rank_memory, settle, stage_cost
from pp_tp.planner.moe import Experts, block_signatures, model_experts, stage_kind
from pp_tp.planner.schedule_sim import schedule_actions
from pp_tp.preflight import resolve_embedding
from pp_tp.split.plan import StagePlan, plan_stages
from pp_tp.stages.stage_module import StageModule


@dataclass
class JobPlan:
    """Everything the dry run found: the job, its mesh and stages, per-rank memory and schedule estimates."""

    cfg: JobConfig
    world_size: int
    mesh: dict[str, int]
    microbatch: int
    plan: StagePlan
    ranks: list[RankMemory]
    schedules: list[ScheduleEstimate]
    seconds: float
    policies: ParallelConfig | None = None  # [parallel] with "auto" resolved (per-pp-rank lists where they differ)
    experts: Experts | None = None  # the model's routed experts (None: dense)
    dims: ModelDims | None = None

    @property
    def peak_bytes(self) -> int:
        """The largest predicted per-rank peak of the configured layout."""
        return max(r.total_bytes for r in self.ranks)


def plan_job(cfg: JobConfig, world_size: int) -> JobPlan:
    """Dry-runs `cfg` on `world_size` ranks in this process; nothing is allocated and nobody is contacted."""
    t0 = time.perf_counter()
    cfg = validate(cfg, world_size)
    # compile and float8 do not run on fake CPU tensors; they leave the accounting unchanged. Neither FSDP
    # policy changes what a stage holds, only when: parallelize with torch's, walk the step with the real ones.
    pcfg = dataclasses.replace(cfg.parallel, compile=False, float8=False)
    fixed = FsdpPolicy.of(pcfg, "default", "step")
    microbatch = cfg.training.batch_size // (pcfg.dp * pcfg.microbatches)
    shape = mesh_shape(pcfg, world_size)
    layout = layout_for(build_model(cfg.model, "meta"))
    if not layout.is_lm:
        raise ConfigError(
            f"pp-tp plan: model layout {layout.name!r} is not a language model, and the planner's estimates assume "
            "token inputs; run it without the planner (pp-tp check still checks it)"
        )
    with fake_world(world_size):
        mesh = make_mesh("cpu", pcfg, world_size)
        model = build_model(cfg.model, "meta")
        layout = layout_for(model)
        pcfg = resolve_embedding(pcfg, layout.dims(model))
        plan = plan_stages(model, layout, pcfg, cfg.training.seq_len)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        # Stages with the same (embed, blocks by signature, head) cost the same, so each kind is parallelized
        # and measured once (a 405B-like plan has 4 kinds of 32 stages; DeepSeek-V3's dense layers differ).
        signatures = block_signatures(model, layout)
        experts = model_experts(model, layout)
        kinds: dict[tuple, StageCost] = {}
        for spec in plan.stages:
            if (kind := stage_kind(spec, signatures)) not in kinds:
                stage, seq = StageModule(model, layout, spec), cfg.training.seq_len
                kinds[kind] = stage_cost(stage, mesh, pcfg, fixed, microbatch, seq, layout.dims(model), fake)
        costs = [[kinds[stage_kind(s, signatures)] for s in plan.for_rank(r)] for r in range(pcfg.pp)]
    ranks = [rank_memory(r, [s.index for s in plan.for_rank(r)], costs[r], pcfg) for r in range(pcfg.pp)]
    actions = schedule_actions(pcfg.schedule, pcfg.pp, pcfg.microbatches, pcfg.stages_per_rank)
    policies = resolve_policies(ranks, actions, cfg.parallel)
    ranks = [dataclasses.replace(r, policy=FsdpPolicy.for_rank(policies, r.pp_rank)) for r in ranks]
    schedules = [schedule_estimate(name, pcfg, ranks) for name in candidate_schedules(pcfg)]
    for r, walk in zip(ranks, schedules[0].walks):
        settle(r, walk)
    return JobPlan(
        cfg,
        world_size,
        {**dict(zip(MESH_DIMS, shape)), **({"ep": pcfg.ep} if pcfg.ep > 1 else {})},
        microbatch,
        plan,
        ranks,
        schedules,
        time.perf_counter() - t0,
        policies,
        experts,
        layout.dims(model),
    )
