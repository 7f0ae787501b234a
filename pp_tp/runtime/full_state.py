"""`Pipeline.iter_full_state_dict()`: the whole model, one full tensor at a time, on every rank (weights handed to an
inference engine between updates).

The tensors are `save_pretrained`'s (`hf_checkpoint.save.owned_tensors`): every parameter under the model's own name
(HF names for HF models), a tied weight once under its canonical name (the first the model names it by, e.g. the
embedding; transformers' save_pretrained leaves the tied head out the same way), and every persistent buffer. The
pp ranks agree on the order once (one all_gather_object of names, shapes and dtypes); then for each tensor the
ranks of its owning pp rank gather it from its TP/FSDP/EP shards into the tensor they yield (`whole_tensor`: at most
one shard beside it, where DTensor's `full_tensor` held 2.5x the tensor) and it is broadcast over pp into the same
tensor elsewhere. So a rank holds at most the full tensor plus one shard of it, while the caller drops each tensor
before asking for the next.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.base.whole_tensor import whole_tensor
from pp_tp.hf_checkpoint.conversion import Reverter
from pp_tp.hf_checkpoint.save import owned_tensors


def iter_full_state_dict(
    parts: list[nn.Module], mesh: DeviceMesh, device: torch.device, config=None, checkpoint_names: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for the whole model, the same sequence on every rank; every rank must drain it (each
    tensor is a collective). With `checkpoint_names`, transformers' reverse conversion renames (and splits) each
    tensor as save_pretrained writes it to disk (per expert where that is the published format).

    Not under `@torch.no_grad()`: its generator wrapper keeps the last (name, tensor) it handed out while it asks for
    the next, so the previous full tensor stayed alive while the next was gathered (measured: +1 tensor at the peak).
    Nothing here records autograd history: the gather runs under no_grad and the rest are detached tensors."""
    owned = owned_tensors(parts)
    group = mesh.get_group("pp")
    plans: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(plans, [(k, tuple(t.shape), t.dtype) for k, t in owned], group=group)
    mine, me = dict(owned), mesh.get_local_rank("pp")
    reverter = Reverter(config) if checkpoint_names else None
    for owner, plan in enumerate(plans):
        for key, shape, dtype in plan:
            if owner == me:
                full = whole_tensor(mine[key].detach())
            else:
                full = torch.empty(shape, dtype=dtype, device=device)
            if len(plans) > 1:
                dist.broadcast(full, group=group, group_src=owner)
            yield from (reverter.convert(key, full) if reverter is not None else {key: full}).items()
            del full
