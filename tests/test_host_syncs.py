"""Host syncs per `Pipeline.step` (pp_tp/diagnostics/host_syncs.py: item, bool, int, float, tolist, numpy and the
ops whose output size needs values): none in a dense step at pp2 x tp2, and under expert parallel one read per MoE
layer and microbatch, the all-to-all's split sizes (pp2 x ep2, 8 layers all MoE: 4 per rank, 4 microbatches).
The cases are bench/host_syncs.py's, which prints the same counts."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from host_syncs import LAYOUTS, syncs_case  # noqa: E402  (bench/host_syncs.py)

from pp_tp.diagnostics.host_syncs import HostSyncs  # noqa: E402


def test_the_counter_sees_reads_that_bypass_dispatch():
    x = torch.arange(6.0)
    with HostSyncs() as syncs:
        x.tolist(), x.numpy(), float(x[0]), bool(x[1]), x[x > 2], torch.bincount(x.long())
        torch.repeat_interleave(x, x.long(), output_size=15)  # sized by the caller: no read
    assert syncs.count == 6 and "tolist" in str(syncs.where), syncs.where
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # unpatched after


def _both_layouts() -> dict:
    """The dense and the MoE case in one round trip (the meshes are pp_tp.build_mesh's: tests/one_trip.py)."""
    return {name: syncs_case(args, **kw) for name, (args, kw) in LAYOUTS.items()}


def test_no_host_sync_in_a_dense_step_and_one_per_moe_layer_and_microbatch(world):
    per_rank = world(4).run(_both_layouts)
    dense = [r["dense pp2 x tp2"] for r in per_rank]
    assert [r["count"] for r in dense] == [0] * 4, [r["where"] for r in dense]
    assert len({r["loss"] for r in dense}) == 1 and dense[0]["loss"] > 0
    for r in (r["MoE pp2 x ep2"] for r in per_rank):
        assert r["moe_calls"] == 16 and r["count"] == r["moe_calls"], r
        assert set(r["where"]) == {next(iter(r["where"]))} and "tolist" in next(iter(r["where"])), r
