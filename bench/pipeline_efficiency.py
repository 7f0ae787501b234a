"""Pipeline efficiency: pp=2 1F1B step time against one rank, the ideal speedup and raw torch pipelining.

    python bench/pipeline_efficiency.py                 # m = 4 8 16, 5 interleaved rounds
    python bench/pipeline_efficiency.py --m 16 --reps 9
    python bench/pipeline_efficiency.py --dim 64 --layers 2 --seq 16 --rows 16 --vocab 64 --reps 9 --profile 30
                                                        # a tiny model: what the framework itself costs per step

Two gloo ranks on CPU, one thread each. Variants run interleaved (1 rank, 1-rank step on both ranks at
once, ours m=4, raw m=4, ours m=8, ...), each round timing one step per variant between barriers; the
table shows medians. Speedup = T(1 rank) / T(variant) on the same global batch; ideal = pp * m /
(m + pp - 1) (the 1F1B bubble); "shared" is how fast a core computes while the other computes too,
relative to alone, so ideal * shared is what this machine allows. "raw" is a hand-split model on
PipelineStage + Schedule1F1B with no pp_tp code; ours/raw is the median of per-round ratios. CPU
columns sum each rank's process time over the step: a waiting rank sleeps, so CPU time is the work
done, and its ratios hold even when a shared machine stretches wall time.
"others' CPU %" is the share of all cores that other processes used during the step (/proc/stat): on a
shared machine anything above 0 slows a 2-rank pipeline on 2 cores far more than the 1-rank baseline.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import World, batch, table
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import pp_tp
from pp_tp.models.reference.model import ModelArgs, Transformer

PP = 2
_BUILT: dict = {}  # per rank process: variant -> (step function or None, parameters)


class RawHalf(nn.Module):
    """A hand-split half of the reference Transformer: embedding + blocks, or blocks + norm + head."""

    def __init__(self, model: Transformer, layers: Sequence[int], first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleList(model.layers[str(i)] for i in layers)
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope", model.rope, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h)) if self.output is not None else h


def mean_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _full_model(args: ModelArgs) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed=0)
    return model


def _build(variant: tuple, args: ModelArgs, rows: int, seq: int) -> tuple[Callable[[], Any] | None, list]:
    kind, m = variant
    ids, labels = batch(args, rows, seq)
    rank = dist.get_rank()
    if kind in ("single", "both"):  # "both": every rank runs the 1-rank step at once (the cores' shared limit)
        if kind == "single" and rank != 0:
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
    module = RawHalf(_full_model(args), range(rank * half, (rank + 1) * half), first=rank == 0, last=rank == PP - 1)
    schedule = Schedule1F1B(PipelineStage(module, rank, PP, torch.device("cpu")), n_microbatches=m, loss_fn=mean_ce)
    step = (lambda: schedule.step(ids)) if rank == 0 else (lambda: schedule.step(target=labels, losses=[]))
    return step, list(module.parameters())


def _machine_busy_s() -> float:
    """CPU seconds all processes on the machine have used since boot (/proc/stat; 0 where it is missing)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except OSError:
        return 0.0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run_variant(variant: tuple, args: ModelArgs, rows: int, seq: int) -> tuple[float, float, float]:
    """One step of `variant` (built and warmed up on first use): (wall seconds, this rank's CPU seconds,
    CPU seconds the whole machine used meanwhile). Multi-rank variants run between barriers, so the
    slowest rank sets the wall time."""
    if variant not in _BUILT:
        _BUILT[variant] = _build(variant, args, rows, seq)
        if _BUILT[variant][0] is not None:
            _BUILT[variant][0]()  # warm-up: shape inference, allocator, first touch
    step, params = _BUILT[variant]
    if step is None:  # the idle rank of the 1-rank baseline
        return 0.0, 0.0, 0.0
    for p in params:
        p.grad = None
    multi = variant[0] != "single"  # "both" too: its ranks start together and the slower one counts
    if multi:
        dist.barrier()
    wall, cpu, busy = time.perf_counter(), time.process_time(), _machine_busy_s()
    step()
    if multi:
        dist.barrier()
    return time.perf_counter() - wall, time.process_time() - cpu, _machine_busy_s() - busy


def profile_variant(variant: tuple, args: ModelArgs, rows: int, seq: int, steps: int) -> tuple[float, str]:
    """cProfile of `steps` steps of `variant` on this rank: total seconds, and the top functions by own time."""
    run_variant(variant, args, rows, seq)  # build and warm up outside the profile
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        run_variant(variant, args, rows, seq)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(12)
    return stats.total_tt, out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[4, 8, 16], help="microbatch counts")
    parser.add_argument("--reps", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--rows", type=int, default=32, help="global batch rows")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="then cProfile STEPS steps of ours and raw at the largest m, on every rank",
    )
    a = parser.parse_args()
    args = ModelArgs(vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=8, ffn_dim=3 * a.dim, max_seq_len=a.seq)
    variants = [("single", 0), ("both", 0)] + [(kind, m) for m in a.m for kind in ("ours", "raw")]
    wall: dict[tuple, list[float]] = {v: [] for v in variants}
    cpu: dict[tuple, list[float]] = {v: [] for v in variants}
    others: dict[tuple, list[float]] = {v: [] for v in variants}  # share of the cores other processes used
    load = os.getloadavg()[0]
    world = World(PP)
    try:
        for _ in range(a.reps):  # A B C A B C ...: a noisy neighbour's load spreads over all variants
            for v in variants:
                results = world.run(run_variant, v, args, a.rows, a.seq)
                wall[v].append(results[0][0])
                cpu[v].append(sum(r[1] for r in results))
                others[v].append(max(0.0, results[0][2] - cpu[v][-1]) / (results[0][0] * os.cpu_count()))
        profiles = (
            {
                kind: world.run(profile_variant, (kind, max(a.m)), args, a.rows, a.seq, a.profile)
                for kind in ("ours", "raw")
            }
            if a.profile
            else {}
        )
    finally:
        world.close()

    def paired(x: tuple, y: tuple, d: dict) -> float:
        return statistics.median(p / q for p, q in zip(d[x], d[y]))

    single = statistics.median(wall[("single", 0)])
    # Both cores busy at once run slower than one alone (shared caches, memory bandwidth, clocks): the
    # most a 2-rank pipeline can reach on this machine is ideal * shared.
    shared = single / statistics.median(wall[("both", 0)])
    rows = [
        (
            "m",
            "ideal",
            "ours speedup",
            "ours/ideal",
            "ours/(ideal*shared)",
            "raw speedup",
            "raw/ideal",
            "ours/raw wall",
            "ours/raw CPU",
            "1-rank CPU / ours CPU",
            "ours s",
            "raw s",
            "others' CPU % (1-rank/ours/raw)",
        )
    ]
    for m in a.m:
        ideal = PP * m / (m + PP - 1)
        ours, raw = statistics.median(wall[("ours", m)]), statistics.median(wall[("raw", m)])
        rows.append(
            (
                m,
                f"{ideal:.3f}",
                f"{single / ours:.3f}",
                f"{single / ours / ideal:.3f}",
                f"{single / ours / ideal / shared:.3f}",
                f"{single / raw:.3f}",
                f"{single / raw / ideal:.3f}",
                f"{paired(('ours', m), ('raw', m), wall):.4f}",
                f"{paired(('ours', m), ('raw', m), cpu):.4f}",
                f"{statistics.median(cpu[('single', 0)]) / statistics.median(cpu[('ours', m)]):.3f}",
                f"{ours:.3f}",
                f"{raw:.3f}",
                "/".join(f"{100 * statistics.median(others[v]):.0f}" for v in (("single", 0), ("ours", m), ("raw", m))),
            )
        )
    print(
        f"model dim={a.dim} layers={a.layers} vocab={a.vocab}; global batch {a.rows}x{a.seq}; pp={PP}, 1F1B; "
        f"{a.reps} rounds, medians; 1-rank step {single:.3f} s; shared = T(1 rank alone) / T(1-rank step on "
        f"both ranks at once) = {shared:.3f}; load average before/after: {load:.1f}/"
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(table(rows))
    for kind, per_rank in profiles.items():
        for rank, (total, listing) in enumerate(per_rank):
            print(f"\n--- {kind}, m={max(a.m)}, rank {rank}: {total:.3f} s in {a.profile} steps under cProfile")
            print(listing[listing.index("ncalls") :].rstrip())


if __name__ == "__main__":
    main()
