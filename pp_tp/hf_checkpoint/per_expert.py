"""Writing packed experts one expert at a time: what `save_pretrained` gathers, and how a gathered expert splits
into the on-disk tensors transformers' reverse conversion names.

A packed expert tensor (`mlp.experts.gate_up_proj [E, 2F, D]`, sharded by EP, TP and FSDP) is never gathered
whole: each gather is one index of its expert dim (the layout's `ExpertsSpec`), and transformers' own conversion,
read forward over the reverse conversion's on-disk names (`conversion.build_views`), says where each on-disk
tensor lies in it (`views.walk_box`, the walk a per-rank read makes). A family that stores its experts packed on
disk (GPT-OSS) is still gathered expert by expert, into the one on-disk tensor its file holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard

from pp_tp.base._torch import StridedShard, local_index_runs, local_shape_and_offset
from pp_tp.hf_checkpoint.conversion import Reverter, build_views
from pp_tp.hf_checkpoint.views import Leaf, View, walk_box


@dataclass(frozen=True)
class Unit:
    """What one gather-and-write step covers: model tensor `key` whole (`dim` None: transformers' reverse conversion
    of the gathered tensor), or the indices `experts` of its expert dim `dim`, gathered one at a time and split by
    `view` into the on-disk tensors `disk` (on-disk key -> shape) they complete."""

    key: str
    disk: dict[str, tuple[int, ...]]
    dim: int | None = None
    experts: tuple[int, ...] = ()
    view: View | None = None

    def nbytes(self, itemsize: int) -> int:
        return sum(math.prod(s) for s in self.disk.values()) * itemsize


def expert_dims(parts: list[nn.Module]) -> dict[str, int]:
    """Checkpoint key -> expert dim of every packed expert parameter the stages hold (their layout's ExpertsSpec)."""
    out = {}
    for part in parts:
        spec = part.layout.experts_spec
        if spec is None:
            continue
        for index, block in part.get_submodule(part.layout.blocks).named_children():
            for name, module in block.named_modules():
                if name and spec.holds(name):
                    for p in dict(module.named_parameters(recurse=False)):
                        fqn = f"{part.layout.blocks}.{index}.{name}.{p}"
                        out[part.checkpoint_keys[fqn]] = spec.expert_dim
    return out


def units(
    key: str, shape: tuple[int, ...], dtype, disk: dict[str, tuple], dim: int | None, rev: Reverter
) -> list[Unit]:
    """The units `key` is written in: one per expert (or per run of experts sharing an on-disk tensor) when it is a
    packed expert tensor whose on-disk tensors transformers' conversion reads as a view of it; else one, whole."""
    view = _view(key, shape, dtype, disk, rev) if dim is not None else None
    if view is None:
        return [Unit(key, disk)]
    slab = torch.empty(shape[:dim] + (1,) + shape[dim + 1 :], device="meta")
    groups: list[tuple[list[int], set[str]]] = []
    for e in range(shape[dim]):
        touched: set[str] = set()
        walk_box(view, _at(len(shape), dim, e), slab, lambda leaf, off, piece, seen=touched: seen.add(leaf.key))
        if groups and groups[-1][1] & touched:  # an on-disk tensor holding several experts: one unit for them
            groups[-1][0].append(e)
            groups[-1][1].update(touched)
        else:
            groups.append(([e], touched))
    return [Unit(key, {k: s for k, s in disk.items() if k in ks}, dim, tuple(es), view) for es, ks in groups]


def _view(key: str, shape: tuple, dtype, disk: dict[str, tuple], rev: Reverter) -> View | None:
    """transformers' conversion of the on-disk tensors `disk` (names and shapes its reverse conversion gives) into
    `key`, as from_pretrained would read them back; None when it is not a view pp_tp walks (then written whole)."""
    if rev.model is None:
        return Leaf(key, "", shape, dtype) if disk == {key: shape} else None
    leaves = {k: Leaf(k, "", s, dtype) for k, s in disk.items()}
    try:
        views, unused = build_views("save_pretrained", leaves, rev.model, {key: shape})
    except ValueError:  # ConfigError included: an operation with no per-rank reading
        return None
    return views.get(key) if not unused else None


def _at(ndim: int, dim: int, index: int) -> tuple[int, ...]:
    return tuple(index if d == dim else 0 for d in range(ndim))


def local_positions(t: torch.Tensor, dim: int) -> dict[int, int]:
    """Global index along `dim` -> its position in this rank's local tensor, for the indices this rank holds."""
    runs = local_index_runs(t)
    if runs is not None:
        out, pos = {}, 0
        for start, n in runs[dim]:
            out.update({start + i: pos + i for i in range(n)})
            pos += n
        return out
    shape, offset = local_shape_and_offset(t)
    return {offset[dim] + i: i for i in range(shape[dim])}


def gather_expert(t: torch.Tensor, dim: int, index: int, positions: dict[int, int]) -> torch.Tensor:
    """Index `index` of `t`'s dim `dim` (kept, size 1), whole on every rank of its mesh; a collective over it.

    The rank holding the index gives its slice and every other rank along the mesh dims sharding `dim` zeros, summed
    there (`Partial`), while the other dims gather as `full_tensor` does: one expert crosses the wire, never the
    packed tensor (`positions`: `local_positions(t, dim)`)."""
    if not isinstance(t, DTensor):
        return t.narrow(dim, index, 1)
    local = t.to_local()
    piece = local.narrow(dim, positions[index], 1) if index in positions else local.new_zeros(_one(local.shape, dim))
    placements = [Partial() if isinstance(p, (Shard, StridedShard)) and p.dim == dim else p for p in t.placements]
    shape = torch.Size(_one(t.shape, dim))
    sliced = DTensor.from_local(piece, t.device_mesh, placements, run_check=False, shape=shape, stride=_strides(shape))
    return sliced.full_tensor()


def _one(shape, dim: int) -> tuple[int, ...]:
    return tuple(1 if d == dim else n for d, n in enumerate(shape))


def _strides(shape: torch.Size) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def write_expert(unit: Unit, index: int, expert: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    """Copies the gathered expert `index` of `unit.key` into its on-disk tensors in `out` (allocated on first use)."""

    def put(leaf: Leaf, offset: tuple[int, ...], piece: torch.Tensor) -> None:
        if leaf.key not in out:
            out[leaf.key] = torch.empty(unit.disk[leaf.key], dtype=expert.dtype)
        out[leaf.key][tuple(slice(o, o + n) for o, n in zip(offset, piece.shape))].copy_(piece)

    walk_box(unit.view, _at(expert.dim(), unit.dim, index), expert, put)
