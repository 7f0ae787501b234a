"""Gradient-norm clipping over the local model parts of a pipelined, TP- and FSDP-sharded model.

torch.nn.utils.get_total_norm handles DTensors of one mesh and placement; a pipeline rank holds
DTensors of several (FSDP on dp, FSDP x TP on dp and tp) and plain tensors, and the pp dimension is
not a DTensor dimension at all. So: one norm per (mesh, placements) group, made whole through its
DTensor placements (replicated dims are not double counted), combined locally, then summed (or
maxed) across pp ranks, whose parameters are disjoint.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _grouped(model_parts: Iterable[nn.Module], counted: bool = False) -> list[list[nn.Parameter]]:
    """Parameters that have gradients, grouped by the gradient's (mesh, placements); plain ones by device.

    `counted`: only the copy of a tied weight held under its canonical name (a stage's `checkpoint_keys`),
    so the norm counts a tied weight once however many stages hold it."""
    groups: dict[object, list[nn.Parameter]] = defaultdict(list)
    for part in model_parts:
        keys = getattr(part, "checkpoint_keys", {})
        for name, p in part.named_parameters():
            g = p.grad
            if g is not None and not (counted and keys.get(name, name) != name):
                groups[(g.device_mesh, g.placements) if isinstance(g, DTensor) else g.device].append(p)
    return list(groups.values())


def _group_norm(params: list[nn.Parameter], norm_type: float) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).float()


def _total_norm(groups: list[list[nn.Parameter]], mesh: DeviceMesh, norm_type: float) -> torch.Tensor:
    device = groups[0][0].grad.device if groups else torch.device(mesh.device_type)
    norms = torch.stack([_group_norm(g, norm_type).to(device) for g in groups] or [torch.zeros((), device=device)])
    inf = math.isinf(norm_type)
    total = norms.max() if inf else norms.pow(norm_type).sum()
    if mesh["pp"].size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=mesh.get_group("pp"))
    return total if inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def total_grad_norm(model_parts: Iterable[nn.Module], mesh: DeviceMesh, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients of the whole model, as a single-process run would compute it, on every rank."""
    return _total_norm(_grouped(model_parts, counted=True), mesh, norm_type)


@torch.no_grad()
def clip_grad_norm_(
    model_parts: Iterable[nn.Module], max_norm: float, mesh: DeviceMesh, norm_type: float = 2.0
) -> torch.Tensor:
    """Scales all local gradients so the whole model's gradient norm is at most `max_norm`; returns that norm.

    Every rank of the mesh must call it (it all-reduces over pp and gathers DTensor norms over tp/dp).
    """
    total = _total_norm(_grouped(model_parts, counted=True), mesh, norm_type)
    for params in _grouped(model_parts):  # one call per group: foreach kernels do not mix DTensors of different meshes
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
