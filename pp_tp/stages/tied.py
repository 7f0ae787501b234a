"""Tied weights held by several stages (Megatron's embedding group): one gradient, summed once per step.

A model that ties its input and output embeddings has one parameter under two names. When the first and
last stage live apart, each holds a copy (same init, same sharding); after the step's last backward their
gradients are summed, locally where one rank holds both (V schedules) and over a group of just the ranks
holding a copy, so every copy sees the whole gradient and the optimizer keeps them identical.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from pp_tp.base._torch import local_tensor
from pp_tp.split.plan import StagePlan
from pp_tp.stages.stage_module import canonical_names


def tied_names(model: nn.Module) -> list[list[str]]:
    """Every parameter the model lists under more than one name: its names, the canonical one first."""
    names: dict[str, list[str]] = defaultdict(list)
    for name, key in canonical_names(model).items():
        names[key].append(name)
    return [group for group in names.values() if len(group) > 1]


def _holders(plan: StagePlan, names: list[str]) -> list[int]:
    """The pp ranks whose stages hold a module one of `names` lives in."""
    return sorted({s.rank for s in plan.stages if any(n.startswith(f + ".") for f in s.fqns for n in names)})


class TiedWeights:
    """Sums the gradients of tied copies across this rank's stages and the pp ranks holding them."""

    def __init__(self, tied: list[list[str]], plan: StagePlan, mesh: DeviceMesh):
        """`tied`: `tied_names(model)`, taken before any stage is materialized."""
        self.keys: list[str] = []
        self.groups: dict[str, dist.ProcessGroup | None] = {}
        grid = mesh.mesh  # global ranks, [pp, dp_replicate, dp_shard, tp]
        for names in tied:
            key, holders = names[0], _holders(plan, names)
            self.keys.append(key)
            self.groups[key] = None
            if len(holders) < 2:
                continue
            # every rank creates every group, in the same order (torch's rule for new_group)
            for coord in itertools.product(*(range(n) for n in grid.shape[1:])):
                ranks = [int(grid[(pp, *coord)]) for pp in holders]
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    self.groups[key] = group

    @torch.no_grad()
    def sync(self, parts: Iterable[nn.Module]) -> None:
        """After the step's last backward: every copy's gradient becomes the sum over all copies."""
        parts = list(parts)
        for key in self.keys:
            copies = [
                p
                for part in parts
                for name, p in part.named_parameters()
                if part.checkpoint_keys[name] == key and p.grad is not None
            ]
            grads = [local_tensor(_as_placed(p)) for p in copies]
            group = self.groups[key]
            if not grads or (len(grads) == 1 and group is None):
                continue
            total = torch.stack(grads).sum(0)
            if group is not None:
                dist.all_reduce(total, group=group)
            for g in grads:
                g.copy_(total)


def _as_placed(p: nn.Parameter) -> torch.Tensor:
    """The gradient in its parameter's placements, so every copy's local shard covers the same rows (a
    vocab-parallel embedding's gradient comes back Replicate while its weight is Shard(0))."""
    g = p.grad
    if isinstance(g, DTensor) and g.placements != p.placements:
        p.grad = g = g.redistribute(p.device_mesh, p.placements)
    return g
