"""The planner's stages, built the way a rank builds its own: `preflight`, then `build_local_stages` on meta.

One path with the runtime (`pp_tp.build.build_pipeline` calls the same two functions), so every rule the runtime
enforces refuses the plan with the same line, and every pass (TP -> experts -> AC -> FSDP) shapes the stage the
planner measures. Under the fake process group (`fake_world`), on the meta device: nothing is allocated or filled.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.config import JobConfig, ParallelConfig
from pp_tp.config.fsdp_policy import FsdpPolicy
from pp_tp.materialize import build_local_stages
from pp_tp.preflight import Preflight, PreflightInputs, preflight
from pp_tp.split.plan import StagePlan, StageSpec
from pp_tp.stages.stage_module import StageModule

META = torch.device("meta")


def checked_job(model: nn.Module, cfg: JobConfig, pcfg: ParallelConfig, mesh: DeviceMesh) -> Preflight:
    """The runtime's model rules for `model` under `pcfg` (the job's sequence length, document masks, loss and
    `[moe]`, as `pp-tp check` passes them); its `parallel` has the model-dependent defaults resolved."""
    return preflight(model, pcfg, PreflightInputs.of_job(cfg, mesh.device_type))


def build_stage(
    model: nn.Module, checked: Preflight, spec: StageSpec, mesh: DeviceMesh, fsdp: FsdpPolicy
) -> StageModule:
    """Stage `spec` of `model` as its pp rank builds it (`build_local_stages`), on meta: pruned and parallelized,
    never allocated. `fsdp`: the policy to shard with (what a stage holds does not depend on it, only when)."""
    one = StagePlan([spec], checked.plan.pp, checked.plan.split)
    (stage,) = build_local_stages(model, checked.layout, one, spec.rank, mesh, checked.parallel, fsdp, META)
    return stage
