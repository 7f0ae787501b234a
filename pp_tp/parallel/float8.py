"""Float8 training through torchao (`parallel.float8 = true`): Linear -> torchao Float8Linear after TP, before AC/FSDP.

Converted: every nn.Linear of the stage whose local (TP-sharded) weight has both dims divisible by 16
(float8 matmuls need that), never the output head (its logits feed the loss and are precision-sensitive)
nor the embedding (not a Linear). Scaling is torchao's default: dynamic, tensorwise, e4m3 for inputs
and weights, e5m2 for output gradients.

TP styles: pp_tp's TP has no sequence parallel, so the plain torch Colwise/Rowwise styles are kept.
torchao's Float8ColwiseParallel / Float8RowwiseParallel only move the input cast before an SP
all-gather (so the activation is gathered in float8); without SP there is no such gather. On a
TP-sharded DTensor weight, Float8Linear takes the amax over the whole weight (one all-reduce), so the
float8 values equal the unsharded model's (tests/test_float8.py measures it).

The swap keeps the module's forward hooks (home-made, one reason: torchao's swap replaces the module
object, which would drop the input/output hooks TP's parallel styles registered on the Linear).
`parallel.float8_fsdp_all_gather = true` makes FSDP all-gather the weights in float8 (torchao's
WeightWithDynamicFloat8CastTensor); it needs FSDP and no TP (under TP the weight already is a DTensor).
Refused before any collective (check_float8) where torchao is missing or a GPU cannot run float8 matmuls.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from pp_tp.base._torch import copy_forward_hooks
from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError


def check_float8(pcfg: ParallelConfig, device_type: str) -> None:
    """Refuses float8 without torchao, on a CUDA GPU of compute capability < 8.9, and FSDP float8
    all-gather without FSDP or with TP. CPU runs torchao's float8 matmuls (emulated, slowly)."""
    if not pcfg.float8:  # float8_fsdp_all_gather alone has nothing to gather in float8
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            "parallel.float8 = true needs torchao, which is not installed; "
            "pip install 'pp_tp[float8]' or set parallel.float8 = false"
        )
    if device_type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        raise ConfigError(
            f"parallel.float8 = true needs an NVIDIA GPU of compute capability >= 8.9 (Ada, Hopper or newer), "
            f"this one has {torch.cuda.get_device_capability()}; set parallel.float8 = false"
        )
    if pcfg.float8_fsdp_all_gather and (pcfg.dp_shard == 1 or pcfg.tp > 1):
        raise ConfigError(
            f"parallel.float8_fsdp_all_gather = true needs FSDP without TP (dp_shard > 1, tp = 1), got "
            f"dp_shard = {pcfg.dp_shard}, tp = {pcfg.tp}; set parallel.float8_fsdp_all_gather = false"
        )


def _local_shape(weight: torch.Tensor) -> tuple[int, ...]:
    return tuple(weight.to_local().shape if isinstance(weight, DTensor) else weight.shape)


def float8_fqns(stage: nn.Module) -> list[str]:
    """The stage's Linear layers float8 converts: local dims divisible by 16, not the output head."""
    head = stage.layout.head
    return [
        fqn
        for fqn, m in stage.named_modules()
        if isinstance(m, nn.Linear) and fqn != head and all(d % 16 == 0 for d in _local_shape(m.weight))
    ]


def _swap(stage: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_fqn, _, name = fqn.rpartition(".")
    old = stage.get_submodule(fqn)
    copy_forward_hooks(old, new)
    setattr(stage.get_submodule(parent_fqn) if parent_fqn else stage, name, new)


def apply_float8(stage: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig) -> bool:
    """Swaps the selected Linear layers for torchao Float8Linear, keeping names, parameters and TP hooks;
    True when any was swapped."""
    if not pcfg.float8:
        return False
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=pcfg.float8_fsdp_all_gather)
    fqns = float8_fqns(stage)
    for fqn in fqns:
        _swap(stage, fqn, Float8Linear.from_float(stage.get_submodule(fqn), config=config))
    return bool(fqns)
