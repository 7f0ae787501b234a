"""Step time of pp2 x cp2 (4 ranks) against pp2 (2 ranks) on the same global tokens, paired round by round.

    python bench/context_parallel.py
    python bench/context_parallel.py --seq 2048 --rounds 7

Both worlds stay up for the whole run (tests/harness.py's World: gloo, one thread per rank); each round times one
step of pp2, then one of pp2 x cp2, on the same batch, after a warm-up step each. Reported per variant: the median
over rounds of the slowest rank's wall time and of the CPU seconds all its ranks spent (process time), and per round
the ratio cp2 / pp2. cp2 runs each rank on half of every sequence (head-tail chunks) and all-gathers keys and values
in every attention layer; on a CPU with fewer cores than ranks the ranks share cores, so wall time says more about
the machine than about cp: CPU seconds are the fairer ratio here, and absolute times only count from a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from common import World, batch, table

import pp_tp
from pp_tp.models.reference.model import ModelArgs, Transformer

_PIPE: dict = {}


def build(pcfg: pp_tp.ParallelConfig, args: ModelArgs, rows: int, seq: int) -> None:
    """On every rank: the pipeline (kept for the timed steps) and one warm-up step."""
    torch.manual_seed(0)
    pipe = pp_tp.build_pipeline(Transformer(args), pp_tp.build_mesh(pcfg), pcfg, seq_len=seq)
    _PIPE["pipe"], _PIPE["batch"] = pipe, batch(args, rows, seq)
    pipe.step(*_PIPE["batch"])


def timed_step() -> tuple[float, float]:
    """On every rank: (wall, CPU) seconds of one step."""
    wall, cpu = time.perf_counter(), time.process_time()
    _PIPE["pipe"].step(*_PIPE["batch"])
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=4, help="global batch (sequences)")
    parser.add_argument("--rounds", type=int, default=5)
    a = parser.parse_args()
    args = ModelArgs(vocab_size=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=a.seq)
    variants = {"pp2": 1, "pp2 x cp2": 2}
    load0 = os.getloadavg()[0]
    worlds = {}
    try:
        for name, cp in variants.items():
            pcfg = pp_tp.ParallelConfig(
                pp=2, cp=cp, dp_shard=1, schedule="1F1B", microbatches=2, mixed_precision="fp32"
            )
            worlds[name] = World(pcfg.world_size)
            worlds[name].run(build, pcfg, args, a.rows, a.seq)
        walls: dict[str, list[float]] = {n: [] for n in variants}
        cpus: dict[str, list[float]] = {n: [] for n in variants}
        for _ in range(a.rounds):
            for name in variants:
                out = worlds[name].run(timed_step)
                walls[name].append(max(w for w, _ in out))
                cpus[name].append(sum(c for _, c in out))
    finally:
        for w in worlds.values():
            w.close()
    ratios = [c / p for p, c in zip(walls["pp2"], walls["pp2 x cp2"])]
    cpu_ratios = [c / p for p, c in zip(cpus["pp2"], cpus["pp2 x cp2"])]
    rows = [("variant", "ranks", "median wall s", "median CPU s (all ranks)")]
    for name, cp in variants.items():
        rows.append((name, 2 * cp, f"{statistics.median(walls[name]):.3f}", f"{statistics.median(cpus[name]):.3f}"))
    print(
        f"model dim={args.dim} layers={args.n_layers} heads={args.n_heads}/{args.n_kv_heads} vocab={args.vocab_size}; "
        f"global batch {a.rows}x{a.seq}; 1F1B, m=2; fp32; {a.rounds} rounds; {os.cpu_count()} CPUs; "
        f"load average before/after {load0:.1f}/{os.getloadavg()[0]:.1f}"
    )
    print(table(rows))
    print(
        "cp2/pp2 wall per round: " + " ".join(f"{r:.3f}" for r in ratios) + f" (median {statistics.median(ratios):.3f})"
    )
    print(
        "cp2/pp2 CPU per round:  " + " ".join(f"{r:.3f}" for r in cpu_ratios)
        + f" (median {statistics.median(cpu_ratios):.3f})"
    )  # fmt: skip


if __name__ == "__main__":
    main()
