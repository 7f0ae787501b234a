"""Per-rank stage building: prune to this rank's stages, parallelize on meta, then materialize and fill.

Only this rank's stages are ever allocated, so peak parameter memory is about the rank's share of the
model, never the whole model. Every tensor a stage holds gets its value here, by FQN: parameters from the
seeded init (identical to the single-process init, because it depends only on (seed, FQN)), from the model
itself, a full state dict or an HF checkpoint; persistent buffers from the same source, or from the layout's
own init rule on a seeded build; non-persistent buffers from the layout. Nothing is left as `to_empty` memory:
persistent buffers are poisoned first, and one still poisoned at the end is refused in one line.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.base.seeded_init import seeded_value
from pp_tp.base.tensors import copy_full_, persistent_buffers
from pp_tp.config import ParallelConfig
from pp_tp.config.fsdp_policy import FsdpPolicy
from pp_tp.errors import ConfigError
from pp_tp.hf_checkpoint.load import load_stage
from pp_tp.hf_checkpoint.source import HFSource
from pp_tp.layout import ModelLayout
from pp_tp.parallel.apply import parallelize_stage
from pp_tp.split.plan import StagePlan
from pp_tp.stages.stage_module import StageModule, canonical_names


def _capture_weights(stage: StageModule) -> dict[str, torch.Tensor]:
    """A model handed over with real weights: keep its parameters and persistent buffers by canonical FQN, then
    treat the stage like a meta one."""
    named = dict(stage.named_parameters())
    weights = {stage.checkpoint_keys[k]: p.detach().clone() for k, p in named.items()}
    weights.update({k: b.detach().clone() for k, b in persistent_buffers(stage).items()})
    stage.to_empty(device="meta")
    return weights


# A bool buffer's byte holding 2 is neither False (0) nor True (1): the one sentinel a bool tensor can carry.
_BOOL_SENTINEL = 2


def _poison(buffer: torch.Tensor) -> None:
    """Marks a buffer as not yet given a value: NaN, an integer sentinel (`_int_sentinel`), byte 2 for bools."""
    if buffer.is_floating_point() or buffer.is_complex():
        buffer.fill_(float("nan"))
    elif buffer.dtype == torch.bool:
        buffer.view(torch.uint8).fill_(_BOOL_SENTINEL)
    else:
        buffer.fill_(_int_sentinel(buffer.dtype))


def _is_poisoned(buffer: torch.Tensor) -> bool:
    if buffer.is_floating_point() or buffer.is_complex():
        return bool(torch.isnan(buffer).any())
    if buffer.dtype == torch.bool:
        return bool((buffer.view(torch.uint8) == _BOOL_SENTINEL).any())
    return bool((buffer == _int_sentinel(buffer.dtype)).any())


def _int_sentinel(dtype: torch.dtype) -> int:
    """The signed dtype's lowest value, the unsigned one's highest (its lowest, 0, is too common a real value)."""
    info = torch.iinfo(dtype)
    return info.min if dtype.is_signed else info.max


def _value(values: Mapping[str, torch.Tensor], fqn: str, shape: torch.Size) -> torch.Tensor:
    if fqn not in values:
        raise ConfigError(
            f"state_dict has no {fqn!r}; pass the full model's state dict "
            "(keys are its FQNs: parameters and persistent buffers)"
        )
    full = values[fqn]
    if tuple(full.shape) != tuple(shape):
        raise ConfigError(f"state_dict[{fqn!r}] has shape {tuple(full.shape)}, the model needs {tuple(shape)}")
    return full


@torch.no_grad()
def fill_stage(stage: StageModule, model: nn.Module, seed: int, state_dict: Mapping[str, torch.Tensor] | None) -> None:
    """Writes values into every (possibly sharded) parameter and persistent buffer, by FQN."""
    layout = stage.layout
    n_layers = layout.dims(model).n_layers
    for name, p in stage.named_parameters():
        fqn = stage.checkpoint_keys[name]  # a tied copy takes its value under the canonical name
        if state_dict is None:
            full = seeded_value(seed, fqn, p.shape, layout.init_std(fqn, n_layers))
        else:
            full = _value(state_dict, fqn, p.shape)
        copy_full_(p, full.to(p.dtype))  # fp32 (FSDP keeps fp32 shards under bf16), or float64
    if state_dict is not None:
        for fqn, b in persistent_buffers(stage).items():
            b.copy_(_value(state_dict, fqn, b.shape).to(b.dtype))


@torch.no_grad()
def materialize(
    stage: StageModule,
    model: nn.Module,
    device: torch.device,
    seed: int = 0,
    values: Mapping[str, torch.Tensor] | None = None,
    checkpoint: HFSource | None = None,
    casts: Counter | None = None,
) -> None:
    """Allocates `stage` on `device` and gives every tensor its value (module docstring); the one way a stage
    leaves the meta device, for pipelined ranks and the self-check alike."""
    stage.to_empty(device=device)
    for b in persistent_buffers(stage).values():
        _poison(b)
    stage.layout.init_buffers(stage, model)  # non-persistent buffers; persistent ones by the model's own rule
    if checkpoint is not None:  # an HF checkpoint: only this rank's slices are read
        load_stage(stage, checkpoint, casts)
    else:
        fill_stage(stage, model, seed, values)
    unset = [fqn for fqn, b in persistent_buffers(stage).items() if _is_poisoned(b)]
    if unset:
        raise ConfigError(
            f"model {type(model).__name__}: persistent buffer {unset[0]!r} gets no value from its layout's init "
            "rule (for Hugging Face models, the model's _init_weights); pass the model holding its weights, a "
            "state_dict or a checkpoint that has it"
        )


def build_local_stages(
    model: nn.Module,
    layout: ModelLayout,
    plan: StagePlan,
    pp_rank: int,
    mesh: DeviceMesh,
    pcfg: ParallelConfig,
    fsdp: FsdpPolicy,
    device: torch.device,
    seed: int = 0,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    checkpoint: HFSource | None = None,
    casts: Counter | None = None,
) -> list[StageModule]:
    """This rank's stage modules: pruned, parallelized (TP -> float8 -> AC -> compile -> FSDP), materialized, filled.
    On the meta `device` they stay shapes only (the planner's dry run): nothing is allocated or filled."""
    stages = []
    # Both read off the model before its first stage is materialized (which replaces shared modules' tensors).
    aliases = canonical_names(model)
    has_weights = any(not p.is_meta for p in model.parameters())
    for spec in plan.for_rank(pp_rank):
        stage = StageModule(model, layout, spec, aliases)
        weights = _capture_weights(stage) if has_weights else None
        parallelize_stage(stage, mesh, pcfg, fsdp)
        if device.type != "meta":
            materialize(stage, model, device, seed, weights if weights is not None else state_dict, checkpoint, casts)
        stages.append(stage)
    return stages
