"""`Pipeline.logprobs` on a sequence length it has not seen vs one whose schedule it kept (issue 49: one shape
inference per new shape, cached; its cost).

    python bench/logprobs_shapes.py [--rounds 3]

4 ranks, pp2 x tp2 (vocab-parallel head), the reference model (dim 64, 4 layers, vocab 256), 8 rows. Each round
walks the lengths 8, 12, ..., 32 with a fresh pipeline: every length is called twice in a row, the first call builds
its schedule (stage shapes, PipelineStages, the schedule's first-run buffers), the second reuses it, so new and
cached are timed side by side under the same load. Printed: the median time of each kind, their ratio, and the
schedule builds counted per kind (a wrapper around the build; exact).
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import World, batch, table

import pp_tp
from pp_tp.models.reference.model import ModelArgs, Transformer

ARGS = ModelArgs(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
LENGTHS = list(range(8, 33, 4))


def case(rounds: int) -> dict:
    import torch

    pcfg = pp_tp.ParallelConfig(pp=2, tp=2, microbatches=2, embedding="vocab_parallel", loss_parallel=True)
    mesh = pp_tp.build_mesh(pcfg)
    times: dict[str, list[float]] = {"new": [], "cached": []}
    builds = {"new": 0, "cached": 0}
    for _ in range(rounds):
        with torch.device("meta"):
            model = Transformer(ARGS)
        pipe = pp_tp.build_pipeline(model, mesh, pcfg, seed=0)
        count, build = [0], pipe._build_schedule

        def counted(*a, build=build, count=count):
            count[0] += 1
            return build(*a)

        pipe._build_schedule = counted
        ids, labels = batch(ARGS, 8, max(LENGTHS))
        for seq in LENGTHS:
            for kind in ("new", "cached"):
                before, start = count[0], time.perf_counter()
                pipe.logprobs(ids[:, :seq], labels[:, :seq])
                times[kind].append(time.perf_counter() - start)
                builds[kind] += count[0] - before
    return {"times": times, "builds": builds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    world = World(4)
    try:
        r = world.run(case, a.rounds)[0]
    finally:
        world.close()
    med = {k: statistics.median(v) for k, v in r["times"].items()}
    rows = [["call", "calls", "schedule builds", "median ms"]]
    rows += [[k, len(r["times"][k]), r["builds"][k], f"{1e3 * med[k]:.1f}"] for k in ("new", "cached")]
    print(table(rows))
    print(f"new shape / cached shape: {med['new'] / med['cached']:.2f}x (rank 0)")


if __name__ == "__main__":
    main()
