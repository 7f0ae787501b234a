"""Float8 training through torchao (`parallel.float8 = true`): Linear -> Float8Linear after TP, before AC/FSDP.

Converted: every nn.Linear of the stage whose local (TP-sharded) weight has both dims divisible by 16
(float8 matmuls need that), never the output head (its logits feed the loss and are precision-
sensitive). FSDP's float8 all-gather is on only without TP: it wraps the weight in a tensor subclass
of torchao's, and under TP the weight already is a DTensor.

The swap keeps the module's forward hooks (home-made, one reason: torchao replaces the module object,
which would drop the input/output hooks TP's parallel styles registered on the Linear).
Refused at build time (check_float8) where torchao is missing or the GPU cannot run float8 matmuls.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.parallel.fsdp import uses_fsdp

_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def check_float8(pcfg: ParallelConfig, device_type: str) -> None:
    """Refuses `parallel.float8 = true` without torchao or without a GPU of compute capability >= 8.9."""
    if not pcfg.float8:
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            "parallel.float8 = true needs torchao, which is not installed; "
            "pip install 'pp_tp[float8]' or set parallel.float8 = false"
        )
    if device_type != "cuda" or torch.cuda.get_device_capability() < (8, 9):
        where = "a CPU" if device_type != "cuda" else f"compute capability {torch.cuda.get_device_capability()}"
        raise ConfigError(
            f"parallel.float8 = true needs an NVIDIA GPU of compute capability >= 8.9 (Ada, Hopper "
            f"or newer) but this job runs on {where}; set parallel.float8 = false"
        )


def float8_all_gather(pcfg: ParallelConfig) -> bool:
    """FSDP all-gathers float8 weights only when there is FSDP and no TP."""
    return uses_fsdp(pcfg) and pcfg.tp == 1


def _torchao_from_float(pcfg: ParallelConfig) -> Callable[[nn.Linear], nn.Linear]:
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=float8_all_gather(pcfg))
    return functools.partial(Float8Linear.from_float, config=config)


# pcfg -> the function turning one nn.Linear into its float8 version; CPU tests put a fake here.
CONVERTER: Callable[[ParallelConfig], Callable[[nn.Linear], nn.Linear]] = _torchao_from_float


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
    for hooks in _HOOK_DICTS:
        getattr(new, hooks).update(getattr(old, hooks))
    setattr(stage.get_submodule(parent_fqn) if parent_fqn else stage, name, new)


def apply_float8(stage: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig) -> bool:
    """Swaps the selected Linear layers for float8 ones, keeping names and TP hooks; True when any was swapped."""
    if not pcfg.float8:
        return False
    fqns = float8_fqns(stage)
    if fqns:
        convert = CONVERTER(pcfg)
        for fqn in fqns:
            _swap(stage, fqn, convert(stage.get_submodule(fqn)))
    return bool(fqns)
