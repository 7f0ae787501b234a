"""Ours against raw at the operator level: every aten op of one step with its shapes, strides, dtype and alignment.

    python bench/op_diff.py                                     # hf 1F1B m=16, issue 16's shape
    python bench/op_diff.py --model ref --schedule Interleaved1F1B --m 8 --dim 256 --rows 16

One step of each side after warm-up (same builds as bench/pipeline_efficiency.py) runs under a
TorchDispatchMode that counts each (op, [shape, stride, dtype, data_ptr % 64, requires_grad] per tensor
argument). Printed per rank: the op totals and every key whose count differs between ours and raw.
Counts are exact, so a busy machine does not matter.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

import pipeline_efficiency as pe
import torch
import torch.distributed as dist
from common import World

from pp_tp.base._torch import TorchDispatchMode, tree_flatten


class OpCounter(TorchDispatchMode):
    """Counts every aten op by its tensor arguments' layout."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        flat, _ = tree_flatten((args, kwargs or {}))
        key = tuple(
            (tuple(t.shape), t.stride(), str(t.dtype), t.data_ptr() % 64 if t.numel() else -1, t.requires_grad)
            for t in flat
            if isinstance(t, torch.Tensor)
        )
        self.counts[(str(func), key)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(variant: tuple, a: argparse.Namespace) -> Counter:
    """One counted step of `variant` on this rank (after building and a timed step)."""
    pe.run_variant(variant, a)
    step, params = pe._BUILT[variant]
    for p in params:
        p.grad = None
    dist.barrier()
    with OpCounter() as counter:
        step()
    dist.barrier()
    return counter.counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="hf", choices=["ref", "hf"])
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--m", type=int, default=16)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    a = parser.parse_args()
    world = World(pe.PP)
    try:
        res = {k: world.run(count_ops, (a.model, a.schedule, a.m, k), a) for k in ("ours", "raw")}
    finally:
        world.close()
    for rank in range(pe.PP):
        ours, raw = res["ours"][rank], res["raw"][rank]
        print(f"--- rank {rank}: {sum(ours.values())} ops ours, {sum(raw.values())} raw; keys whose counts differ:")
        for key in sorted(set(ours) | set(raw), key=str):
            if ours[key] != raw[key]:
                print(f"  ours {ours[key]:>4}  raw {raw[key]:>4}  {key[0]} {str(key[1])[:140]}")


if __name__ == "__main__":
    main()
