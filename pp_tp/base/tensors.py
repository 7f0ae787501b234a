"""Copy whole (unsharded) values into parameters that may be DTensors, with no communication; a module's state."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from pp_tp.base._torch import is_persistent_buffer


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers that belong to the model's state (state_dict, checkpoints), by FQN: each one needs a value."""
    out = {}
    for name, b in module.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if is_persistent_buffer(module.get_submodule(owner), leaf):
            out[name] = b
    return out


@torch.no_grad()
def copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Writes this rank's shard of ``full`` into ``param``.

    ``distribute_tensor(src_data_rank=None)`` slices locally: every rank already holds ``full``
    (it comes from a seed or a state dict), so scattering from rank 0 would only add traffic.
    """
    if isinstance(param, DTensor):
        shard = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """`t` in fp32 where it is narrower (bf16 compute of norms, rotations, losses), float64 left float64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a parameter or gradient, gathering if it is a DTensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t
