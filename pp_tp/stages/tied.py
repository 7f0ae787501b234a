"""Tied weights held by several stages (Megatron's embedding group): one gradient, summed once per step.

A model that ties its input and output embeddings has one parameter under two names; one whose layers share a block
(Zamba2's shared transformer, reused by several hybrid layers) has each of that block's parameters under one name per
layer. When the stages naming a weight live apart, each holds a copy (same init, same sharding); after the step's last
backward their gradients are summed, locally where one rank holds several and over a group of just the pp ranks
holding a copy (one group per set of such ranks, one all-reduce per group and dtype for all the weights they tie), so
every copy sees the whole gradient and the optimizer keeps them identical.
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
from pp_tp.base.per_world import once_per_world
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


def _own_group(rows: tuple[tuple[int, ...], ...]) -> dist.ProcessGroup | None:
    """Makes one group per row of ranks (every rank makes every group, in the same order: torch's rule for
    new_group); this rank's, or None where no row holds it."""
    own = None
    for ranks in rows:
        group = dist.new_group(list(ranks))
        if dist.get_rank() in ranks:
            own = group
    return own


class TiedWeights:
    """Sums the gradients of tied copies across this rank's stages and the pp ranks holding them."""

    def __init__(self, tied: list[list[str]], plan: StagePlan, mesh: DeviceMesh):
        """`tied`: `tied_names(model)`, taken before any stage is materialized."""
        self.keys: list[str] = []
        self.holders: dict[str, tuple[int, ...]] = {}
        self.groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        grid = mesh.mesh  # global ranks, [pp, dp_replicate, dp_shard, tp]
        for names in tied:
            key, holders = names[0], tuple(_holders(plan, names))
            self.keys.append(key)
            self.holders[key] = holders
            if len(holders) < 2 or holders in self.groups:
                continue
            # One group per set of holding pp ranks and mesh coordinate, shared by every weight those ranks tie (a
            # block shared by several layers ties each of its parameters), and by later builds on the same ranks.
            rows = tuple(
                tuple(int(grid[(pp, *coord)]) for pp in holders)
                for coord in itertools.product(*(range(n) for n in grid.shape[1:]))
            )
            self.groups[holders] = once_per_world(("tied", rows), lambda rows=rows: _own_group(rows))

    @torch.no_grad()
    def sync(self, parts: Iterable[nn.Module]) -> None:
        """After the step's last backward: every copy's gradient becomes the sum over all copies. A copy this rank's
        layers did not use counts zero; a weight no copy used keeps no gradient, as in the plain model."""
        parts = list(parts)
        buckets: dict[tuple, list[list[nn.Parameter]]] = defaultdict(list)
        for key in self.keys:
            copies = [p for part in parts for name, p in part.named_parameters() if part.checkpoint_keys[name] == key]
            group = self.groups.get(self.holders[key])
            if copies and (len(copies) > 1 or group is not None):
                buckets[(self.holders[key] if group is not None else (), str(copies[0].dtype))].append(copies)
        for (holders, _), tied in sorted(buckets.items()):  # the same order on every holding rank
            _sum_copies(tied, self.groups[holders] if holders else None)


def _sum_copies(tied: list[list[nn.Parameter]], group: dist.ProcessGroup | None) -> None:
    """Each weight's copies' summed gradient, over `group` too: one all-reduce for all of them, each weight's sum
    followed by its count of copies with a gradient (all zero: it keeps none)."""
    pieces = []
    for copies in tied:
        grads = [local_tensor(_as_placed(p)) for p in copies if p.grad is not None]
        total = torch.stack(grads).sum(0) if grads else torch.zeros_like(local_tensor(copies[0]))
        pieces += [total.flatten(), total.new_full((1,), float(len(grads)))]
    flat = torch.cat(pieces)
    if group is not None:
        dist.all_reduce(flat, group=group)
    at = 0
    for copies in tied:
        n = local_tensor(copies[0]).numel()
        total, used = flat[at : at + n], flat[at + n]
        at += n + 1
        missing = [p for p in copies if p.grad is None]
        if missing and not used:  # the count is read (a host sync) only where a copy has no gradient
            continue
        for p in missing:
            p.grad = torch.zeros_like(p)
        for p in copies:
            local_tensor(p.grad).copy_(total.view_as(local_tensor(p.grad)))


def _as_placed(p: nn.Parameter) -> torch.Tensor:
    """The gradient in its parameter's placements, so every copy's local shard covers the same rows (a
    vocab-parallel embedding's gradient comes back Replicate while its weight is Shard(0))."""
    g = p.grad
    if isinstance(g, DTensor) and g.placements != p.placements:
        p.grad = g = g.redistribute(p.device_mesh, p.placements)
    return g
