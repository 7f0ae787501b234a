"""Gradient-norm clipping over the local model parts of a pipelined, TP- and FSDP-sharded model.

torch.nn.utils.get_total_norm handles DTensors of one mesh and placement; a pipeline rank holds
DTensors of several (FSDP on dp, FSDP x TP on dp and tp) and plain tensors, and the pp dimension is
not a DTensor dimension at all. Going through DTensor per group also costs one collective per group
plus DTensor's per-op dispatch (bench/trainer_loop.py: clipping was 5 % of a debug_cpu step). So the
norm is taken on local shards, each gradient value counted by exactly one rank of the mesh, and the
partial sums are reduced in one all-reduce: pp stages hold disjoint values, a dimension a gradient is
sharded over holds disjoint pieces, and over a dimension it is replicated on, only the rank at
coordinate 0 counts it. Scaling is one foreach multiply over the local shards.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from pp_tp.base._torch import foreach_mul_
from pp_tp.parallel.mesh import flattened


def _counts_here(grad: torch.Tensor, coords: dict[str, int]) -> bool:
    """Whether this rank counts its local values of `grad`: it is at coordinate 0 of every non-pp mesh dimension
    the gradient is replicated over (a plain gradient is replicated over all of them)."""
    sharded = set()
    if isinstance(grad, DTensor):
        flat = flattened(tuple(coords))
        for name, placement in zip(grad.device_mesh.mesh_dim_names or (), grad.placements):
            if name in flat and name not in coords:  # e.g. expert parallel's "dp_shard" spans two mesh dims
                sharded.update(flat[name] if not placement.is_replicate() else ())
                continue
            if name not in coords:  # e.g. a flattened dimension: which mesh ranks it spans is not known here
                raise RuntimeError(f"a gradient lives on mesh dim {name!r}, not one of {sorted(coords)}")
            if placement.is_partial():  # Pipeline.step reduces these; a pending sum has no local norm
                raise RuntimeError(f"a gradient is still Partial on mesh dim {name!r}; reduce it before clipping")
            if not placement.is_replicate():  # Shard, and FSDP x TP's _StridedShard (not a Shard subclass)
                sharded.add(name)
    return all(c == 0 for name, c in coords.items() if name not in sharded)


def _local_grads(model_parts: Iterable[nn.Module], mesh: DeviceMesh) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every local gradient shard, and the ones this rank counts in the norm. A tied weight is counted once, under
    its canonical name (a stage's `checkpoint_keys`), however many stages hold a copy."""
    coords = {name: mesh.get_local_rank(name) for name in mesh.mesh_dim_names if name != "pp"}
    every, counted = [], []
    for part in model_parts:
        keys = getattr(part, "checkpoint_keys", {})
        for name, p in part.named_parameters():
            g = p.grad
            if g is None:
                continue
            local = g.to_local() if isinstance(g, DTensor) else g
            every.append(local)
            if keys.get(name, name) == name and _counts_here(g, coords):
                counted.append(local)
    return every, counted


def _total_norm(counted: list[torch.Tensor], mesh: DeviceMesh, norm_type: float) -> torch.Tensor:
    device = counted[0].device if counted else torch.device(mesh.device_type)
    # float64 on every rank (one may count nothing): exact enough for fp32 runs, and float64 runs stay float64
    norm = torch.nn.utils.get_total_norm(counted, norm_type) if counted else torch.zeros((), device=device)
    norm = norm.double()
    inf = math.isinf(norm_type)
    total = norm if inf else norm.pow(norm_type)
    # A sum (or max) over the whole mesh: one all-reduce when the mesh is the world, else one per dimension.
    whole = mesh.size() == dist.get_world_size()
    for group in [None] if whole else [mesh.get_group(n) for n in mesh.mesh_dim_names if mesh[n].size() > 1]:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    return total if inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def total_grad_norm(model_parts: Iterable[nn.Module], mesh: DeviceMesh, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients of the whole model, as a single-process run would compute it, on every rank."""
    return _total_norm(_local_grads(model_parts, mesh)[1], mesh, norm_type)


@torch.no_grad()
def clip_grad_norm_(
    model_parts: Iterable[nn.Module], max_norm: float, mesh: DeviceMesh, norm_type: float = 2.0
) -> torch.Tensor:
    """Scales all local gradients so the whole model's gradient norm is at most `max_norm`; returns that norm.

    Every rank of the mesh must call it (it all-reduces over the mesh). Same factor as torch's
    clip_grads_with_norm_: max_norm / (norm + 1e-6), at most 1.
    """
    every, counted = _local_grads(model_parts, mesh)
    total = _total_norm(counted, mesh, norm_type)
    if every:
        foreach_mul_(every, (max_norm / (total + 1e-6)).clamp(max=1.0).to(every[0].device))
    return total
