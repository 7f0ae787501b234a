"""A model tensor as a composition of on-disk tensors, read box by box without building the whole.

transformers keeps experts packed in memory (`mlp.experts.gate_up_proj [E, 2F, D]`) while checkpoints store
them per expert; its conversion mapping stacks and concatenates them on load (`conversion.py` reads that mapping
into these records). A rank needs only its block of the packed tensor, so a box read here walks the composition
and reads, from each on-disk tensor it touches, only the part inside the box (`walk_box`; save.py walks it the other
way, one expert at a time): under EP the rank's experts, under TP its rows of gate and of up. No full packed tensor
is ever built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Leaf:
    """One on-disk tensor. Quantized (`method` "fp8" or "mxfp4", quantized.py): `scale` is its scale tensor (block
    FP8's `weight_scale_inv` per `block`, MXFP4's `*_scales`), `shape` the dequantized one."""

    key: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    scale: Leaf | None = None
    block: tuple[int, int] | None = None
    method: str | None = None


@dataclass(frozen=True)
class Stack:
    """`torch.stack(parts, dim)`: transformers' MergeModulelist (one tensor per expert -> the packed one)."""

    dim: int
    parts: tuple[View, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        inner = list(self.parts[0].shape)
        inner.insert(self.dim, len(self.parts))
        return tuple(inner)


@dataclass(frozen=True)
class Cat:
    """`torch.cat(parts, dim)`: transformers' Concatenate (gate and up -> gate_up)."""

    dim: int
    parts: tuple[View, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        out = list(self.parts[0].shape)
        out[self.dim] = sum(p.shape[self.dim] for p in self.parts)
        return tuple(out)


@dataclass(frozen=True)
class Transposed:
    """`part.transpose(dim0, dim1)`: transformers' Transpose."""

    dim0: int
    dim1: int
    part: View

    @property
    def shape(self) -> tuple[int, ...]:
        out = list(self.part.shape)
        out[self.dim0], out[self.dim1] = out[self.dim1], out[self.dim0]
        return tuple(out)


View = Leaf | Stack | Cat | Transposed

# (leaf, offset, piece): the leaf's box at `offset` (of piece's shape) and the part of the model box it is, a view:
# a read fills `piece` from the leaf (converting its dtype), a write copies `piece` into the leaf
Visit = Callable[[Leaf, tuple[int, ...], torch.Tensor], None]


def leaves(view: View) -> Iterator[Leaf]:
    """Every on-disk tensor `view` is made of, in order."""
    if isinstance(view, Leaf):
        yield view
    elif isinstance(view, Transposed):
        yield from leaves(view.part)
    else:
        for part in view.parts:
            yield from leaves(part)


def walk_box(view: View, offset: tuple[int, ...], out: torch.Tensor, visit: Visit) -> None:
    """Visits each on-disk piece of the box of `view` at `offset` (of `out`'s shape) with the view of `out` it is:
    a read fills `out` touching only the on-disk bytes inside the box, each piece straight into its place (no second
    copy of the box is ever held); a write (save.py) splits a box of the model tensor into its on-disk tensors."""
    if isinstance(view, Leaf):
        visit(view, offset, out)
        return
    if isinstance(view, Transposed):
        swapped = list(offset)
        swapped[view.dim0], swapped[view.dim1] = swapped[view.dim1], swapped[view.dim0]
        walk_box(view.part, tuple(swapped), out.transpose(view.dim0, view.dim1), visit)
        return
    d = view.dim
    if isinstance(view, Stack):
        rest = offset[:d] + offset[d + 1 :]
        for i in range(out.shape[d]):
            walk_box(view.parts[offset[d] + i], rest, out.select(d, i), visit)
        return
    start = 0
    for part in view.parts:
        n = part.shape[d]
        lo, hi = max(offset[d], start), min(offset[d] + out.shape[d], start + n)
        if lo < hi:
            sub = offset[:d] + (lo - start,) + offset[d + 1 :]
            walk_box(part, sub, out.narrow(d, lo - offset[d], hi - lo), visit)
        start += n
