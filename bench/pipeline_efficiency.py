"""Pipeline efficiency: pp=2 1F1B step time against one rank, the ideal speedup and raw torch pipelining.

    python bench/pipeline_efficiency.py                 # m = 4 8 16, 5 interleaved rounds
    python bench/pipeline_efficiency.py --m 16 --reps 9

Two gloo ranks on CPU, one thread each. Variants run interleaved (1-rank, ours m=4, raw m=4, ours m=8,
...), each round timing one step per variant barrier to barrier; the table shows medians. Speedups
are T(1 rank) / T(variant) on the same global batch; ideal = pp * m / (m + pp - 1) (the 1F1B bubble);
"ours/raw" is the median of per-round ratios against a hand-split model on PipelineStage + Schedule1F1B.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from common import RawHalf, World, batch, interleaved, mean_ce, median, table, timed_step
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import pp_tp
from pp_tp.models.llama import ModelArgs, Transformer

PP = 2
_BUILT: dict = {}  # per rank process: variant -> (step function, parameters)


def _full_model(args: ModelArgs) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed=0)
    return model


def _build(variant: tuple, args: ModelArgs, rows: int, seq: int):
    kind, m = variant
    ids, labels = batch(args, rows, seq)
    rank = dist.get_rank()
    if kind == "single":
        if rank != 0:
            return None, []
        model = _full_model(args)
        return (lambda: mean_ce(model(ids), labels).backward()), list(model.parameters())
    if kind == "ours":
        pcfg = pp_tp.ParallelConfig(pp=PP, dp_shard=1, schedule="1F1B", microbatches=m, mixed_precision="fp32")
        if "mesh" not in _BUILT:
            _BUILT["mesh"] = pp_tp.build_mesh(pcfg)
        with torch.device("meta"):
            meta = Transformer(args)
        pipe = pp_tp.build_pipeline(meta, _BUILT["mesh"], pcfg, seq_len=seq)
        return (lambda: pipe.step(ids, labels)), [p for part in pipe.model_parts for p in part.parameters()]
    half = args.n_layers // PP
    layers = range(rank * half, (rank + 1) * half)
    module = RawHalf(_full_model(args), layers, first=rank == 0, last=rank == PP - 1)
    schedule = Schedule1F1B(PipelineStage(module, rank, PP, torch.device("cpu")), n_microbatches=m, loss_fn=mean_ce)
    if rank == 0:
        return (lambda: schedule.step(ids)), list(module.parameters())
    return (lambda: schedule.step(target=labels, losses=[])), list(module.parameters())


def run_variant(variant: tuple, args: ModelArgs, rows: int, seq: int) -> float:
    """One timed step of `variant` (built and warmed up on first use); rank 0's seconds."""
    if variant not in _BUILT:
        _BUILT[variant] = _build(variant, args, rows, seq)
        step, _ = _BUILT[variant]
        if step is not None:
            step()  # warm-up: shape inference, allocator, first-touch
    step, params = _BUILT[variant]
    if variant[0] == "single":
        if step is None:
            return 0.0
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0
    return timed_step(step, params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[4, 8, 16], help="microbatch counts")
    parser.add_argument("--reps", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--rows", type=int, default=16, help="global batch rows")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    a = parser.parse_args()
    args = ModelArgs(vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=8, ffn_dim=3 * a.dim,
                     max_seq_len=a.seq)
    variants = [("single", 0)] + [(kind, m) for m in a.m for kind in ("ours", "raw")]
    world = World(PP)
    try:
        times = interleaved(world, _Case(args, a.rows, a.seq), variants, a.reps)
    finally:
        world.close()
    single = median(times[("single", 0)])
    rows = [("m", "ideal", "ours speedup", "ours/ideal", "raw speedup", "raw/ideal", "ours/raw (median of rounds)",
             "ours s", "raw s")]
    for m in a.m:
        ideal = PP * m / (m + PP - 1)
        ours, raw = median(times[("ours", m)]), median(times[("raw", m)])
        paired = median([o / r for o, r in zip(times[("ours", m)], times[("raw", m)])])
        rows.append((m, f"{ideal:.3f}", f"{single / ours:.3f}", f"{single / ours / ideal:.3f}", f"{single / raw:.3f}",
                     f"{single / raw / ideal:.3f}", f"{paired:.4f}", f"{ours:.3f}", f"{raw:.3f}"))
    print(f"model dim={a.dim} layers={a.layers} vocab={a.vocab}; global batch {a.rows}x{a.seq}; pp={PP}, 1F1B; "
          f"{a.reps} rounds; 1-rank step {single:.3f} s (median)")
    print(table(rows))


class _Case:
    """Picklable `variant -> seconds` for World.run (spawned ranks import this module by name)."""

    def __init__(self, args: ModelArgs, rows: int, seq: int):
        self.args, self.rows, self.seq = args, rows, seq

    def __call__(self, variant: tuple) -> float:
        return run_variant(variant, self.args, self.rows, self.seq)


if __name__ == "__main__":
    main()
