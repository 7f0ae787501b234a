"""The pipeline's whole parameters and gradients for lockstep's judges, in one all-reduce over the world a step.

`full_tensor` is a collective per sharded tensor (two under FSDP x TP), and the references then need every pp rank's
parameters (an all_gather_object over pp). Here each rank writes the blocks it is the first holder of (no lower rank
holds them) into one float64 buffer laid out for every pp rank's tensors, zeros elsewhere, and one all-reduce sums
it: each element is one rank's value plus zeros, so the result is exact (float64 holds every narrower float), and
every rank gets the whole model. Then each rank writes its own blocks back over the sum: a replica that went astray
is judged on its own rank, as a per-rank `full_tensor` judged it. A block is what `block_runs` says a rank holds, as
`whole_tensor` cuts it (a `_StridedShard` block included). The buffer is the whole model in float64 on each rank's
device, where every rank already holds the two whole references (the plain fp32 model and its float64 copy).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pp_tp.base._torch import block_runs
from pp_tp.base.whole_tensor import Box, boxes

Key = tuple[int, str]  # (pp rank, the tensor's name in that rank's stages)


def _blocks(t: torch.Tensor) -> list[tuple[Box, Box]]:
    """This rank's block of `t`: (where in the whole tensor, where in the local one) per box."""
    if not isinstance(t, DTensor):
        return [(tuple(slice(0, n) for n in t.shape),) * 2]
    mesh = t.device_mesh
    return boxes(block_runs(tuple(t.shape), tuple(mesh.shape), tuple(t.placements), tuple(mesh.get_coordinate())))


class Assembled:
    """Laid out once for a pipeline's tensors (its parameters, by its stages' names; gradients share their layout):
    an all_gather_object of every rank's names and shapes, and an all-reduce (min) that finds each block's first
    holder. Every rank of the world takes part."""

    def __init__(self, tensors: dict[str, torch.Tensor], keys: dict[str, str], pp_rank: int, device: torch.device):
        """`tensors`: this rank's, by its stages' names; `keys`: those names' canonical ones (the model's)."""
        listed: list = [None] * dist.get_world_size()
        mine = [(n, keys[n], tuple(t.shape), t.dtype) for n, t in tensors.items()]
        dist.all_gather_object(listed, (pp_rank, mine))
        self.shapes = {(pp, n): (shape, dtype) for pp, theirs in listed for n, _, shape, dtype in theirs}
        self.keys = {(pp, n): key for pp, theirs in listed for n, key, _, _ in theirs}
        self.offsets, self.total = {}, 0
        for key, (shape, _) in self.shapes.items():
            self.offsets[key], self.total = self.total, self.total + math.prod(shape)
        self.pp_rank, self.device = pp_rank, device
        self.specs = {n: (t.device_mesh, t.placements) for n, t in tensors.items() if isinstance(t, DTensor)}
        self.held = [(n, g, loc) for n, t in tensors.items() for g, loc in _blocks(t)]
        rank, holder = dist.get_rank(), torch.full((self.total,), math.inf, dtype=torch.float64, device=device)
        for n, g, _ in self.held:
            self._whole(holder, (pp_rank, n))[g] = rank
        dist.all_reduce(holder, op=dist.ReduceOp.MIN)
        first = [bool((self._whole(holder, (pp_rank, n))[g] == rank).all()) for n, g, _ in self.held]
        self.writes = [block for block, is_first in zip(self.held, first, strict=True) if is_first]

    def _whole(self, flat: torch.Tensor, key: Key) -> torch.Tensor:
        shape = self.shapes[key][0]
        return flat[self.offsets[key] : self.offsets[key] + math.prod(shape)].view(shape)

    def _local(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`t`'s local tensor as its parameter is laid out (a gradient placed otherwise is redistributed first)."""
        if not isinstance(t, DTensor):
            return t
        mesh, placements = self.specs[name]
        if t.device_mesh != mesh or tuple(t.placements) != tuple(placements):
            t = t.redistribute(mesh, placements)
        return t.to_local()

    @torch.no_grad()
    def every(self, tensors: dict[str, torch.Tensor | None]) -> dict[Key, torch.Tensor | None]:
        """Every pp rank's whole tensors (this rank's `tensors`, laid out as the ones it was made for, and its peers');
        one all-reduce. A None (a gradient that never came) is None here and reads zeros on other pp ranks."""
        flat = torch.zeros(self.total, dtype=torch.float64, device=self.device)
        local = {n: self._local(n, t) for n, t in tensors.items() if t is not None}
        for n, g, loc in self.writes:
            if n in local:
                self._whole(flat, (self.pp_rank, n))[g] = local[n][loc]
        dist.all_reduce(flat)
        for n, g, loc in self.held:  # this rank's own blocks, as it holds them (module docstring)
            if n in local:
                self._whole(flat, (self.pp_rank, n))[g] = local[n][loc]
        out = {key: self._whole(flat, key).to(dtype) for key, (_, dtype) in self.shapes.items()}
        return out | {(self.pp_rank, n): None for n, t in tensors.items() if t is None}

    def own(self, every: dict[Key, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """This rank's part of `every`, by its stages' names."""
        return {n: t for (pp, n), t in every.items() if pp == self.pp_rank}

    def canonical(self, every: dict[Key, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """`every` by the model's names (a tied weight's copies are equal: any one)."""
        return {self.keys[key]: t for key, t in every.items()}
