"""Host syncs per `Pipeline.step` (pp_tp/diagnostics/host_syncs.py: item, bool, int, float, tolist, numpy and the
ops whose output size needs values): none in a dense step at pp2 x tp2, and under expert parallel one read per MoE
layer and microbatch, the all-to-all's split sizes (pp2 x ep2, 8 layers all MoE: 4 per rank, 4 microbatches)."""

from __future__ import annotations

from dataclasses import replace

import parity_utils as pu

import pp_tp
from pp_tp.diagnostics.host_syncs import HostSyncs
from pp_tp.parallel.mesh import dp_rank

MOE = replace(pu.TINY, n_layers=8, n_experts=4, top_k=2, moe_ffn_dim=16, moe_every=1)


def _syncs_case(args, **kw) -> dict:
    """The host syncs of the second step (the first builds the schedule) on this rank, by caller."""
    pcfg = pu.pcfg_of(**kw)
    mesh = pu.mesh_for(pcfg)
    pipe = pp_tp.build_pipeline(pu.make_model(args, device="meta"), mesh, pcfg)
    ids, labels = pu.batch(args, 8, 8)
    rows = 8 // pcfg.dp
    share = slice(dp_rank(mesh) * rows, (dp_rank(mesh) + 1) * rows)
    pipe.step(ids[share], labels[share])
    with HostSyncs() as syncs:
        loss = pipe.step(ids[share], labels[share])
    layers = sum(1 for part in pipe.model_parts for n, _ in part.named_modules() if n.endswith("feed_forward.experts"))
    return {
        "syncs": dict(syncs.where),
        "count": syncs.count,
        "loss": float(loss),
        "moe_calls": layers * pcfg.microbatches,
    }


def test_no_host_sync_in_a_dense_step_and_one_per_moe_layer_and_microbatch(world):
    dense = world(4).run(_syncs_case, pu.TINY, pp=2, tp=2, microbatches=2)
    assert [r["count"] for r in dense] == [0] * 4, [r["syncs"] for r in dense]
    assert len({r["loss"] for r in dense}) == 1 and dense[0]["loss"] > 0
    moe = world(4).run(_syncs_case, MOE, pp=2, dp_shard=2, ep=2, microbatches=4)
    for r in moe:
        assert r["moe_calls"] == 16 and r["count"] <= r["moe_calls"], r
