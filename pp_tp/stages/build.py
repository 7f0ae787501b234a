"""Per-rank stage building: prune to this rank's stages, parallelize on meta, then materialize and fill.

Only this rank's stages are ever allocated, so peak parameter memory is about the rank's share of the
model, never the whole model. Values come from the seeded init (identical to the single-process init,
because it depends only on (seed, FQN)) or from a full state dict keyed by FQN.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.hf_checkpoint.load import load_stage
from pp_tp.hf_checkpoint.source import HFSource
from pp_tp.parallel.apply import parallelize_stage
from pp_tp.seeded_init import seeded_value
from pp_tp.stages.layouts import ModelLayout
from pp_tp.stages.plan import StagePlan
from pp_tp.stages.stage_module import StageModule, canonical_names
from pp_tp.tensor_utils import copy_full_


def _capture_weights(stage: StageModule) -> dict[str, torch.Tensor]:
    """A model handed over with real weights: keep them by canonical FQN, then treat the stage like a meta one."""
    named = dict(stage.named_parameters())
    weights = {stage.checkpoint_keys[k]: p.detach().clone() for k, p in named.items()}
    stage.to_empty(device="meta")
    return weights


@torch.no_grad()
def fill_stage(stage: StageModule, model: nn.Module, seed: int, state_dict: Mapping[str, torch.Tensor] | None) -> None:
    """Writes values into every (possibly sharded) parameter, by FQN; recomputes non-persistent buffers."""
    layout = stage.layout
    layout.init_buffers(stage, model)
    n_layers = layout.dims(model).n_layers
    for name, p in stage.named_parameters():
        fqn = stage.checkpoint_keys[name]  # a tied copy takes its value under the canonical name
        if state_dict is None:
            full = seeded_value(seed, fqn, p.shape, layout.init_std(fqn, n_layers))
        elif fqn in state_dict:
            full = state_dict[fqn]
        else:
            raise ConfigError(f"state_dict has no {fqn!r}; pass the full model's state dict (keys are its FQNs)")
        if tuple(full.shape) != tuple(p.shape):
            raise ConfigError(f"state_dict[{fqn!r}] has shape {tuple(full.shape)}, the model needs {tuple(p.shape)}")
        copy_full_(p, full.to(torch.float32))


def build_local_stages(
    model: nn.Module,
    layout: ModelLayout,
    plan: StagePlan,
    pp_rank: int,
    mesh: DeviceMesh,
    pcfg: ParallelConfig,
    device: torch.device,
    seed: int = 0,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    checkpoint: HFSource | None = None,
    casts: Counter | None = None,
) -> list[StageModule]:
    """This rank's stage modules: pruned, parallelized (TP -> float8 -> AC -> compile -> FSDP), materialized, filled."""
    stages = []
    # Both read off the model before its first stage is materialized (which replaces shared modules' tensors).
    aliases = canonical_names(model)
    has_weights = any(not p.is_meta for p in model.parameters())
    for spec in plan.for_rank(pp_rank):
        stage = StageModule(model, layout, spec, aliases)
        weights = _capture_weights(stage) if has_weights else None
        parallelize_stage(stage, mesh, pcfg)
        stage.to_empty(device=device)
        if checkpoint is not None:  # an HF checkpoint: only this rank's slices are read
            stage.layout.init_buffers(stage, model)
            load_stage(stage, checkpoint, casts)
        else:
            fill_stage(stage, model, seed, weights if weights is not None else state_dict)
        stages.append(stage)
    return stages
