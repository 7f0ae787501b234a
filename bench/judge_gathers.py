"""What lockstep's judges pay to see whole tensors after a step, side by side on one pipeline (issue 46, item 6).

    python bench/judge_gathers.py

Old: `full_tensor` per gradient and per parameter, then an all_gather_object of the parameters over pp (what
pp_tp/parity/lockstep.py did before pp_tp/parity/assembled.py). New: `PipelineRun.grads()` and `every_param()`, one
all-reduce each. Both on the same pipeline after one step of the tiny reference model, alternating, 20 rounds each
behind a barrier; per rank and round, wall and CPU (`process_time`), averaged over ranks. Also checks that both give
bit-equal whole tensors.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import parity_utils as pu  # noqa: E402  (tests/parity_utils.py: the tiny model and its builds)
from common import World, table  # noqa: E402

from pp_tp.base.tensors import full_tensor  # noqa: E402

LAYOUTS = {"pp2 x tp2": (4, dict(pp=2, tp=2)), "pp2 x tp2 x dp2": (8, dict(pp=2, tp=2, dp_shard=2))}
ROUNDS = 20


def gathers_case(kw: dict) -> dict:
    pcfg = pu.pcfg_of(**kw, microbatches=2)
    run = pu.pipeline(pcfg, copy.deepcopy(pu.reference_state()))
    run.step(*pu.batch(pu.TINY, 8, 16))
    named = run._named()
    pp = run.pipe.mesh.get_group("pp")

    def old() -> tuple[dict, dict]:
        grads = {k: full_tensor(p.grad) for k, p in named.items()}
        params = {k: full_tensor(p).detach() for k, p in named.items()}
        every: list = [None] * dist.get_world_size(pp)
        dist.all_gather_object(every, {run.keys[k]: p.cpu() for k, p in params.items()}, group=pp)
        return grads, params

    def new() -> tuple[dict, dict]:
        every = run.every_param()
        run.assembled.canonical(every)
        return run.grads(), run.assembled.own(every)

    (g_old, p_old), (g_new, p_new) = old(), new()
    equal = all(torch.equal(g_old[k], g_new[k]) and torch.equal(p_old[k], p_new[k]) for k in named)
    spent = {"old": [0.0, 0.0], "new": [0.0, 0.0]}
    for _ in range(ROUNDS):
        for name, fn in (("old", old), ("new", new)):
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            spent[name][0] += time.perf_counter() - wall
            spent[name][1] += time.process_time() - cpu
    return {"equal": equal, "spent": spent, "tensors": len(named)}


def main() -> None:
    rows = []
    for name, (ranks, kw) in LAYOUTS.items():
        world = World(ranks)
        results = world.run(gathers_case, kw)
        world.close()
        mean = {
            k: [sum(r["spent"][k][i] for r in results) / ranks / ROUNDS * 1e3 for i in (0, 1)] for k in ("old", "new")
        }
        rows.append(
            [
                name,
                results[0]["tensors"],
                all(r["equal"] for r in results),
                f"{mean['old'][0]:.1f} / {mean['old'][1]:.1f}",
                f"{mean['new'][0]:.1f} / {mean['new'][1]:.1f}",
                f"{mean['new'][0] / mean['old'][0]:.2f}x / {mean['new'][1] / mean['old'][1]:.2f}x",
            ]
        )
    print(table([["layout", "tensors/rank", "bit-equal", "old ms wall/CPU", "new ms wall/CPU", "new/old"], *rows]))


if __name__ == "__main__":
    main()
