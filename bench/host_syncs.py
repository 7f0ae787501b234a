"""Host syncs per `Pipeline.step` (issue 47 item 2), counted by pp_tp.diagnostics.host_syncs on every rank.

    python bench/host_syncs.py

Two 4-rank layouts of the reference model, the second step of each counted (the first builds the schedule): dense
at pp2 x tp2 (2 microbatches), and all-MoE at pp2 x ep2 (dp_shard 2, 8 layers of 4 experts top 2, so 4 MoE layers
per rank, 4 microbatches). Printed per rank: the count and where each read comes from. Counts are exact.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import parity_utils as pu  # noqa: E402  (tests/parity_utils.py: the tiny model, batch and mesh cache)
from harness import World  # noqa: E402

import pp_tp  # noqa: E402
from pp_tp.diagnostics.host_syncs import HostSyncs  # noqa: E402
from pp_tp.parallel.mesh import dp_rank  # noqa: E402

MOE = replace(pu.TINY, n_layers=8, n_experts=4, top_k=2, moe_ffn_dim=16, moe_every=1)
LAYOUTS = {
    "dense pp2 x tp2": (pu.TINY, dict(pp=2, tp=2, microbatches=2)),
    "MoE pp2 x ep2": (MOE, dict(pp=2, dp_shard=2, ep=2, microbatches=4)),
}


def syncs_case(args: pu.ModelArgs, **kw) -> dict:
    """The host syncs of the second step on this rank, by caller; the loss; MoE layer calls (layers x microbatches)."""
    pcfg = pu.pcfg_of(**kw)
    mesh = pp_tp.build_mesh(pcfg)
    pipe = pp_tp.build_pipeline(pu.make_model(args, device="meta"), mesh, pcfg)
    ids, labels = pu.batch(args, 8, 8)
    rows = 8 // pcfg.dp
    share = slice(dp_rank(mesh) * rows, (dp_rank(mesh) + 1) * rows)
    pipe.step(ids[share], labels[share])
    with HostSyncs() as syncs:
        loss = pipe.step(ids[share], labels[share])
    layers = sum(1 for part in pipe.model_parts for n, _ in part.named_modules() if n.endswith("feed_forward.experts"))
    return {
        "count": syncs.count,
        "where": dict(syncs.where),
        "loss": float(loss),
        "moe_calls": layers * pcfg.microbatches,
    }


def main() -> None:
    world = World(4)
    try:
        for name, (args, kw) in LAYOUTS.items():
            for rank, r in enumerate(world.run(syncs_case, args, **kw)):
                calls = f"{r['moe_calls']} MoE layer calls"
                print(f"{name} rank {rank}: {r['count']} host syncs per step ({calls}) {r['where']}")
    finally:
        world.close()


if __name__ == "__main__":
    main()
