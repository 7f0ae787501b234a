"""Ours against raw at the operator level: every aten op of one step with its shapes, strides, dtype and alignment.

    python bench/op_diff.py                                     # hf 1F1B m=16, issue 16's shape
    python bench/op_diff.py --model ref --schedule Interleaved1F1B --m 8 --dim 256 --rows 16
    python bench/op_diff.py --against fsdp                      # 1 stage x 1 microbatch, bf16, vs plain FSDP2

One step of each side after warm-up (same builds as bench/pipeline_efficiency.py) runs under a
TorchDispatchMode that counts each (op, [shape, stride, dtype, data_ptr % 64, requires_grad] per tensor
argument). Printed per rank: the op totals and every key whose count differs between ours and raw.
Counts are exact, so a busy machine does not matter.

`--against fsdp` (issue 47): one rank, pp_tp at one stage and one microbatch (`parallel.mixed_precision = "bf16"`)
against the same model under plain `fully_shard` (each block, then the root) with the same MixedPrecisionPolicy,
its loss the token mean, one forward + backward each: both op tables by op name, the totals and their ratio.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

import pipeline_efficiency as pe
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import World, table
from raw_pipeline import full_model
from torch.distributed.fsdp import fully_shard

import pp_tp
from pp_tp.base._torch import TorchDispatchMode, tree_flatten
from pp_tp.parallel.fsdp import mixed_precision_policy


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


def _fsdp_steps(a: argparse.Namespace) -> dict:
    """(pp_tp step, plain FSDP2 step) on one rank, the same model, weights, batch and mixed precision."""
    ids, labels = pe._batch(a.vocab, a.rows, a.seq)
    pcfg = pp_tp.ParallelConfig(pp=1, dp_shard=1, schedule="1F1B", microbatches=1, mixed_precision="bf16")
    pipe = pp_tp.build_pipeline(full_model(a.model, a.dim, a.layers, a.vocab, a.seq), pp_tp.build_mesh(pcfg), pcfg)
    model = full_model(a.model, a.dim, a.layers, a.vocab, a.seq)
    mesh = pipe.mesh["dp_shard"]
    blocks = model.model.layers if a.model == "hf" else model.layers.values()
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mixed_precision_policy(pcfg))
    fully_shard(model, mesh=mesh, mp_policy=mixed_precision_policy(pcfg))

    def plain() -> None:
        logits = model(ids)
        logits = logits.logits if a.model == "hf" else logits
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()

    return {"pp_tp": (lambda: pipe.step(ids, labels)), "fsdp": plain}, [*pipe.model_parts, model]


def count_fsdp(a: argparse.Namespace) -> dict[str, Counter]:
    """Ops by name of one step of each side, after one warm-up step each."""
    steps, modules = _fsdp_steps(a)
    out = {}
    for name, step in steps.items():
        step()
        for m in modules:
            m.zero_grad(set_to_none=True)
        with OpCounter() as counter:
            step()
        out[name] = Counter()
        for (op, _), n in counter.counts.items():
            out[name][op] += n
    return out


def against_fsdp(a: argparse.Namespace) -> None:
    world = World(1)
    try:
        res = world.run(count_fsdp, a)[0]
    finally:
        world.close()
    ours, fsdp = res["pp_tp"], res["fsdp"]
    rows = [("op", "pp_tp", "fsdp", "diff")]
    for op in sorted(set(ours) | set(fsdp), key=lambda o: (-abs(ours[o] - fsdp[o]), o)):
        rows.append((op, ours[op], fsdp[op], ours[op] - fsdp[op]))
    print(table(rows))
    total_ours, total_fsdp = sum(ours.values()), sum(fsdp.values())
    print(f"total: pp_tp {total_ours} ops, plain FSDP2 {total_fsdp} ops, ratio {total_ours / total_fsdp:.3f}")


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
    parser.add_argument("--against", default="raw", choices=["raw", "fsdp"])
    a = parser.parse_args()
    if a.against == "fsdp":
        against_fsdp(a)
        return
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
