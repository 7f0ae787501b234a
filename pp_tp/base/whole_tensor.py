"""The whole of a sharded tensor on every rank of its mesh, written into one new tensor and nothing else as big.

DTensor's `full_tensor` all-gathers each sharded mesh dim into a buffer of its own and reorders it into another
(at pp2 x tp2 x dp2: 2.5x the full tensor alive at once, measured with tests/test_post_training.py's storage
counter). Here the output is allocated once and each rank's block reaches it by broadcasts (written in place by
NCCL and gloo alike, where gloo's all-gather stages a whole flat buffer), one mesh dim at a time: along a mesh dim,
each rank in turn sends the region of the output it holds so far, straight into the output where that region is
contiguous there, else through a buffer of at most one block (one rank's shard). So a rank holds at most the full
tensor plus one shard beside its own, by construction.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from pp_tp.base._torch import StridedShard, block_runs

Box = tuple[slice, ...]


@torch.no_grad()
def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of `t` (a new tensor when `t` is a DTensor, else `t` itself); a collective over its mesh."""
    if not isinstance(t, DTensor):
        return t
    mesh, local = t.device_mesh, t.to_local()
    shape, placements, me = tuple(t.shape), tuple(t.placements), tuple(mesh.get_coordinate())
    blocks = {
        y: block_runs(shape, tuple(mesh.shape), placements, y) for y in itertools.product(*map(range, mesh.shape))
    }
    limit = max(math.prod(sum(n for _, n in runs) for runs in b) for b in blocks.values())  # one shard, the largest
    out = torch.empty(shape, dtype=t.dtype, device=local.device)
    for box, at in boxes(blocks[me]):
        out[box].copy_(local[at])
    done: list[int] = []
    for axis in _order(placements):
        group = mesh.get_group(axis)
        for src in range(mesh.size(axis)):
            for box in _region(blocks, me, axis, src, done):
                _send(out[box], group, src, me[axis] == src, limit)
        done.append(axis)
    return out


def _order(placements: tuple) -> list[int]:
    """The sharded mesh dims, innermost split first (higher tensor dim, then a _StridedShard, then the later mesh
    dim), so the regions sent later are few, large and mostly contiguous. Any order gives the same tensor."""
    sharded = [a for a, p in enumerate(placements) if isinstance(p, (Shard, StridedShard))]
    return sorted(sharded, key=lambda a: (-placements[a].dim, not isinstance(placements[a], StridedShard), -a))


def boxes(runs: tuple) -> list[tuple[Box, Box]]:
    """A block (index runs per dim) as boxes: (where in the global tensor, where in the block's local tensor)."""
    per_dim = []
    for dim_runs in runs:
        at, pos = [], 0
        for start, n in dim_runs:
            at.append((slice(start, start + n), slice(pos, pos + n)))
            pos += n
        per_dim.append(at)
    return [(tuple(g for g, _ in combo), tuple(loc for _, loc in combo)) for combo in itertools.product(*per_dim)]


def _region(blocks: dict, me: tuple, axis: int, src: int, done: list[int]) -> list[Box]:
    """The boxes the rank at `src` along `axis` holds once the mesh dims `done` are gathered: the blocks of every
    coordinate that equals it off `done`; one box when together they are one (the usual case), else each block's."""
    keep = [a for a in range(len(me)) if a != axis and a not in done]
    held = [y for y in blocks if y[axis] == src and all(y[a] == me[a] for a in keep)]
    parts = [box for y in held for box, _ in boxes(blocks[y])]
    hull = tuple(slice(min(b[d].start for b in parts), max(b[d].stop for b in parts)) for d in range(len(parts[0])))
    return [hull] if _numel(hull) == sum(map(_numel, parts)) else parts


def _numel(box: Box) -> int:
    return math.prod(s.stop - s.start for s in box)


def _send(view: torch.Tensor, group, src: int, is_src: bool, limit: int) -> None:
    """Broadcasts `view` (a box of the output) from group rank `src`: in place when it is contiguous, else in pieces
    of at most `limit` elements (whole rows of its first dim, or each row in turn when one row is larger) through a
    buffer of the piece's size."""
    if view.numel() == 0:
        return
    if view.is_contiguous():
        dist.broadcast(view, group=group, group_src=src)
        return
    row = view[0].numel()
    if row > limit:
        for i in range(view.shape[0]):
            _send(view[i], group, src, is_src, limit)
        return
    step = max(1, limit // max(row, 1))
    for i in range(0, view.shape[0], step):
        piece = view[i : i + step]
        buf = piece.contiguous() if is_src else torch.empty(piece.shape, dtype=piece.dtype, device=piece.device)
        dist.broadcast(buf, group=group, group_src=src)
        if not is_src:
            piece.copy_(buf)
