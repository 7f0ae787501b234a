"""The dry run: the real mesh, and the runtime's preflight and local build of each distinct stage on meta (one path
with build_pipeline, pp_tp.planner.stage_build), in the fake world."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.base._torch import FakeTensorMode
from pp_tp.config import JobConfig, ParallelConfig, validate
from pp_tp.config.fsdp_policy import FsdpPolicy
from pp_tp.errors import ConfigError
from pp_tp.layout import ModelDims, ModelLayout
from pp_tp.models.factory import build_model
from pp_tp.parallel.mesh import MESH_DIMS, make_mesh, mesh_shape
from pp_tp.planner.auto import resolve_policies
from pp_tp.planner.estimates import ScheduleEstimate, candidate_schedules, schedule_estimate
from pp_tp.planner.fake_world import fake_world
from pp_tp.planner.memory import RankMemory, StageCost, rank_memory, settle, stage_cost
from pp_tp.planner.moe import Experts, block_signatures, model_experts, stage_kind
from pp_tp.planner.schedule_sim import schedule_actions
from pp_tp.planner.stage_build import build_stage, checked_job
from pp_tp.preflight import Preflight
from pp_tp.split.plan import StagePlan


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


def _refuse_non_lm(layout: ModelLayout) -> None:
    """The planner's estimates assume token inputs."""
    if not layout.is_lm:
        raise ConfigError(
            f"pp-tp plan: model layout {layout.name!r} is not a language model, and the planner's estimates assume "
            "token inputs; run it without the planner (pp-tp check still checks it)"
        )


def _stage_costs(model: nn.Module, checked: Preflight, mesh: DeviceMesh, microbatch: int, seq: int) -> list[list]:
    """Each pp rank's StageCosts. Stages with the same (embed, blocks by signature, head) cost the same, so each
    kind is built (as its rank builds it, on meta) and measured once (a 405B-like plan has 4 kinds of 32 stages;
    DeepSeek-V3's dense layers differ). Neither FSDP policy changes what a stage holds, only when: stages are
    sharded with torch's, the step is walked with the real ones."""
    pcfg, plan, dims = checked.parallel, checked.plan, checked.dims
    fixed = FsdpPolicy.of(pcfg, "default", "step")
    signatures = block_signatures(model, checked.layout)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    kinds: dict[tuple, StageCost] = {}
    for spec in plan.stages:
        if (kind := stage_kind(spec, signatures)) not in kinds:
            stage = build_stage(model, checked, spec, mesh, fixed)
            kinds[kind] = stage_cost(stage, mesh, pcfg, microbatch, seq, dims, fake)
    return [[kinds[stage_kind(s, signatures)] for s in plan.for_rank(r)] for r in range(pcfg.pp)]


def plan_job(cfg: JobConfig, world_size: int) -> JobPlan:
    """Dry-runs `cfg` on `world_size` ranks in this process; nothing is allocated and nobody is contacted."""
    t0 = time.perf_counter()
    cfg = validate(cfg, world_size)
    # compile and float8 do not run on fake CPU tensors; they leave the accounting unchanged.
    pcfg = dataclasses.replace(cfg.parallel, compile=False, float8=False)
    microbatch = cfg.training.batch_size // (pcfg.dp * pcfg.microbatches)
    shape = mesh_shape(pcfg, world_size)
    with fake_world(world_size):
        mesh = make_mesh("cpu", pcfg, world_size)
        model = build_model(cfg.model, "meta")
        checked = checked_job(model, cfg, pcfg, mesh)  # the runtime's rules, with the runtime's lines
        _refuse_non_lm(checked.layout)
        experts = model_experts(model, checked.layout)
        costs = _stage_costs(model, checked, mesh, microbatch, cfg.training.seq_len)
    pcfg, plan = checked.parallel, checked.plan
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
        {
            **dict(zip(MESH_DIMS, shape)),
            **({"ep": pcfg.ep} if pcfg.ep > 1 else {}),
            **({"cp": pcfg.cp} if pcfg.cp > 1 else {}),
        },
        microbatch,
        plan,
        ranks,
        schedules,
        time.perf_counter() - t0,
        policies,
        experts,
        checked.dims,
    )
