"""`Pipeline.iter_full_state_dict()`: the whole model, one full tensor at a time, on every rank (weights handed to an
inference engine between updates).

The tensors are `save_pretrained`'s (`hf_checkpoint.save.owned_tensors`): every parameter under the model's own name
(HF names for HF models), a tied weight once under its canonical name (the first the model names it by, e.g. the
embedding; transformers' save_pretrained leaves the tied head out the same way), and every persistent buffer. The
pp ranks agree on the order once (one all_gather_object of names, shapes and dtypes); then for each tensor the
ranks of its owning pp rank gather it from its TP/FSDP/EP shards (`full_tensor`) and it is broadcast over pp, so a
rank holds at most one full tensor beside the gather's own buffers. A packed experts tensor is filled one expert at
a time (save_pretrained's `gather_expert`): DTensor's own gather of one sharded over FSDP and EP holds it twice.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from pp_tp.base.tensors import full_tensor
from pp_tp.hf_checkpoint.conversion import Reverter
from pp_tp.hf_checkpoint.per_expert import expert_dims, gather_expert, local_positions
from pp_tp.hf_checkpoint.save import owned_tensors


@torch.no_grad()
def iter_full_state_dict(
    parts: list[nn.Module], mesh: DeviceMesh, device: torch.device, config=None, checkpoint_names: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for the whole model, the same sequence on every rank; every rank must drain it (each
    tensor is a collective). With `checkpoint_names`, transformers' reverse conversion renames (and splits) each
    tensor as save_pretrained writes it to disk (per expert where that is the published format)."""
    owned = owned_tensors(parts)
    group = mesh.get_group("pp")
    plans: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(plans, [(k, tuple(t.shape), t.dtype) for k, t in owned], group=group)
    mine, me, dims = dict(owned), mesh.get_local_rank("pp"), expert_dims(parts)
    reverter = Reverter(config) if checkpoint_names else None
    for owner, plan in enumerate(plans):
        for key, shape, dtype in plan:
            if owner == me:
                full = _full(mine[key].detach(), dims.get(key))
            else:
                full = torch.empty(shape, dtype=dtype, device=device)
            if len(plans) > 1:
                dist.broadcast(full, group=group, group_src=owner)
            yield from (reverter.convert(key, full) if reverter is not None else {key: full}).items()
            del full


def _full(t: torch.Tensor, expert_dim: int | None) -> torch.Tensor:
    """The whole of `t` on every rank of its mesh (a collective); packed experts gathered one expert at a time."""
    if expert_dim is None or not isinstance(t, DTensor):
        return full_tensor(t)
    positions = local_positions(t, expert_dim)
    out = torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
    for e in range(t.shape[expert_dim]):
        out.narrow(expert_dim, e, 1).copy_(gather_expert(t, expert_dim, e, positions))
    return out
