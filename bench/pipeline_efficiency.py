"""Pipeline efficiency: ours against raw torch pipelining, per model, schedule and m, paired and interleaved.

    python bench/pipeline_efficiency.py                       # both models, 5 schedules, m = 4 8 16, 4 round pairs
    python bench/pipeline_efficiency.py --models hf --schedules 1F1B --m 16 --reps 8 --rows 32 --dim 384
                                                              # issue 16's Llama, 1F1B, m = 16
    python bench/pipeline_efficiency.py --quick               # 1 round pair, m = 8 only: a smoke run

pp = 2 gloo ranks on CPU, one thread each. For each (model, schedule, m) "ours" is `pp_tp.build_pipeline`
+ `Pipeline.step` and "raw" the same split written directly on `PipelineStage` + the torch schedule class
(bench/raw_pipeline.py), both over the same weights and global batch. Every round times one step of
each variant between barriers, with every variant's gradients freed first (same memory either way).
Rounds come in twos, ours first then raw first: here a step runs about 1 % slower second in a round than
first (16 rounds of ref 1F1B m=8 and hf 1F1B m=4: median ratio 0.990-0.996 with ours first, 1.012-1.017 with
raw first), so the ratio of a round pair is sqrt(ratio1 * ratio2), which cancels that order effect.
ours/raw is the median of those pair ratios, smallest and largest beside
it; the "per path" table pools every m of a (model, schedule). CPU ratios sum each rank's process time over the step
(a waiting rank sleeps, so CPU time is the work done). "others' CPU %" is the share of all cores that
other processes used during the step (/proc/stat).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common import World, table
from raw_pipeline import full_model, raw_step

import pp_tp
from pp_tp.schedules.registry import default_stages_per_rank

PP = 2
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "DualPipeV"]
_BUILT: dict = {}  # per rank process: variant -> (step function, parameters)


def _batch(vocab: int, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (rows, seq), generator=gen), torch.randint(0, vocab, (rows, seq), generator=gen)


def _build(variant: tuple, a: argparse.Namespace) -> tuple[Callable[[], Any], list]:
    model_kind, schedule, m, kind = variant
    ids, labels = _batch(a.vocab, a.rows, a.seq)
    model = full_model(model_kind, a.dim, a.layers, a.vocab, a.seq)
    if kind == "raw":
        return raw_step(model, a.layers, schedule, m, ids, labels, PP)
    pcfg = pp_tp.ParallelConfig(
        pp=PP,
        dp_shard=1,
        schedule=schedule,
        microbatches=m,
        stages_per_rank=default_stages_per_rank(schedule, PP),
        mixed_precision="fp32",
    )
    if "mesh" not in _BUILT:
        _BUILT["mesh"] = pp_tp.build_mesh(pcfg)
    pipe = pp_tp.build_pipeline(model, _BUILT["mesh"], pcfg, seq_len=a.seq)  # takes the model's weights
    return (lambda: pipe.step(ids, labels)), [p for part in pipe.model_parts for p in part.parameters()]


def _machine_busy_s() -> float:
    """CPU seconds all processes on the machine have used since boot (/proc/stat; 0 where it is missing)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except OSError:
        return 0.0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run_variant(variant: tuple, a: argparse.Namespace) -> tuple[float, float, float]:
    """One step of `variant` (built and warmed up on first use), between barriers: (wall seconds, this
    rank's CPU seconds, CPU seconds the whole machine used meanwhile)."""
    if variant not in _BUILT:
        _BUILT[variant] = _build(variant, a)
        _BUILT[variant][0]()  # warm-up: shape inference, allocator, first touch
    step = _BUILT[variant][0]
    for key, built in _BUILT.items():
        if key != "mesh":
            for p in built[1]:
                p.grad = None
    dist.barrier()
    wall, cpu, busy = time.perf_counter(), time.process_time(), _machine_busy_s()
    step()
    dist.barrier()
    return time.perf_counter() - wall, time.process_time() - cpu, _machine_busy_s() - busy


def release(keys: list[tuple]) -> None:
    """Frees the built variants of one case (their memory) once the case is measured."""
    for k in keys:
        _BUILT.pop(k, None)


def _pairs(res: dict, case: tuple, i: int) -> list[float]:
    """One ratio per round pair (ours first, then raw first): the geometric mean cancels the order effect."""
    ratios = [o[i] / r[i] for o, r in zip(res[case + ("ours",)], res[case + ("raw",)])]
    return [math.sqrt(a * b) for a, b in zip(ratios[0::2], ratios[1::2])]


def _spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"


def _row(case: tuple, res: dict, others: dict) -> tuple:
    wall, cpu = _pairs(res, case, 0), _pairs(res, case, 1)
    return (
        *case[:2],
        default_stages_per_rank(case[1], PP),
        case[2],
        f"{statistics.median(r[0] for r in res[case + ('ours',)]):.3f}",
        f"{statistics.median(r[0] for r in res[case + ('raw',)]):.3f}",
        _spread(wall),
        _spread(cpu),
        "/".join(f"{100 * statistics.median(others[case + (k,)]):.0f}" for k in ("ours", "raw")),
    )


def measure(world: World, cases: list[tuple], a: argparse.Namespace) -> list[tuple]:
    """Paired interleaved rounds over `cases`; returns the table rows."""
    res: dict[tuple, list[tuple[float, float]]] = {c + (k,): [] for c in cases for k in ("ours", "raw")}
    others: dict[tuple, list[float]] = {k: [] for k in res}
    for case in cases:  # builds stay alive only for the case being measured (memory)
        for r in range(a.rounds):
            for kind in ("ours", "raw") if r % 2 == 0 else ("raw", "ours"):
                out = world.run(run_variant, case + (kind,), a)
                wall, cpu = out[0][0], sum(x[1] for x in out)
                res[case + (kind,)].append((wall, cpu))
                others[case + (kind,)].append(max(0.0, out[0][2] - cpu) / (wall * os.cpu_count()))
        world.run(release, [case + (k,) for k in ("ours", "raw")])
    rows = [_row(c, res, others) for c in cases]
    paths = sorted({c[:2] for c in cases}, key=lambda p: [c[:2] for c in cases].index(p))
    pooled = [
        (
            *p,
            len(ms),
            _spread([x for c in ms for x in _pairs(res, c, 0)]),
            _spread([x for c in ms for x in _pairs(res, c, 1)]),
        )
        for p in paths
        for ms in [[c for c in cases if c[:2] == p]]
    ]
    return rows, pooled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["ref", "hf"], choices=["ref", "hf"])
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES)
    parser.add_argument("--m", type=int, nargs="+", default=[4, 8, 16], help="microbatch counts")
    parser.add_argument("--reps", type=int, default=4, help="round pairs per case (each: ours first, then raw first)")
    parser.add_argument("--rows", type=int, default=16, help="global batch rows")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="1 round pair at m = 8: a smoke run")
    a = parser.parse_args()
    if a.quick:
        a.reps, a.m = 1, [8]
    a.rounds = 2 * a.reps
    cases = [(model, s, m) for model in a.models for s in a.schedules for m in a.m]
    load, start = os.getloadavg()[0], time.perf_counter()
    world = World(PP)
    try:
        rows, pooled = measure(world, cases, a)
    finally:
        world.close()
    print(
        f"dim={a.dim} layers={a.layers} vocab={a.vocab}; global batch {a.rows}x{a.seq}; pp={PP}, fp32, 1 thread per "
        f"rank; {a.reps} round pairs per case; load average before/after: {load:.1f}/{os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores; {time.perf_counter() - start:.0f} s"
    )
    header = ("model", "schedule", "v", "m", "ours s", "raw s", "ours/raw wall [min-max]", "ours/raw CPU [min-max]")
    print(table([header + ("others' CPU % (ours/raw)",)] + rows))
    print("per path, every m pooled:")
    print(table([("model", "schedule", "cases", "ours/raw wall [min-max]", "ours/raw CPU [min-max]")] + pooled))


if __name__ == "__main__":
    main()
