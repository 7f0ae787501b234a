"""TP collectives of a block whose mixer is not softmax attention, counted at the family level (the whole pipeline,
one step of 2 microbatches): a gated-delta-net (linear-attention) block of Qwen3.5 at tp2 costs Megatron's minimum
per microbatch, 2 all-reduces of the activation forward and 2 backward (1 + 1 for the head-split mixer,
parallel/mixer_tp.py, 1 + 1 for the MLP), like a softmax-attention block; once per step, one all-reduce sums the
partial gradient of each mixer parameter kept whole on every TP rank (the packed q/k/v projection of unequal parts,
its depthwise conv, the norm shared by all heads). One block's count is a 3-layer build minus a 2-layer one: layers
cycle the family's types (linear, full, linear), so the difference is one linear-attention block."""

from __future__ import annotations

from collections import Counter

import parity_utils as pu
import test_hf_mixers as mx
from hf_utils import SEQ, VOCAB
from test_tensor_parallel import _CollectiveLog

import pp_tp
from pp_tp.models.reference.model import ModelArgs

MICROBATCHES, ROWS = 2, 4


def _added_block(name: str, layers: tuple[int, int]) -> dict:
    """{(phase, op, shape): count} the bigger build's extra layers add to one step on the TP group, and the shapes
    of those layers' parameters that TP keeps whole (Replicate)."""
    pcfg = pu.pcfg_of(pp=1, tp=2, schedule="1F1B", microbatches=MICROBATCHES)
    counts = []
    for n in layers:
        pipe = pp_tp.build_pipeline(mx.FAMILIES[name].make("meta", n), pp_tp.build_mesh(pcfg), pcfg)
        with _CollectiveLog() as log:
            pipe.step(*pu.batch(ModelArgs(vocab_size=VOCAB), ROWS, SEQ))
        counts.append(Counter(log.calls))
    counts[1].subtract(counts[0])
    added = pipe.model_parts[0].get_submodule(f"model.layers.{layers[0]}")
    whole = sorted(
        (n, tuple(p.shape))
        for n, p in added.named_parameters()
        if "Replicate" in str(getattr(p, "placements", "")) and n.startswith("linear_attn.")
    )
    return {"calls": {k: n for k, n in counts[1].items() if n}, "whole": whole}


def _linear_attention_block() -> dict:
    return _added_block("qwen3_5_text", (2, 3))


def test_a_linear_attention_block_costs_two_all_reduces_each_way_at_tp2(world):
    hidden = (ROWS // MICROBATCHES, SEQ, 64)
    for r in world(2).run(_linear_attention_block):
        assert [n for n, _ in r["whole"]] == [
            "linear_attn.conv1d.weight",
            "linear_attn.in_proj_qkv.weight",
            "linear_attn.norm.weight",
        ], r
        want = {("fwd", "all_reduce", hidden): 2 * MICROBATCHES, ("bwd", "all_reduce", hidden): 2 * MICROBATCHES}
        want.update({("fwd", "all_reduce", shape): 1 for _, shape in r["whole"]})  # once per step, after backward
        assert r["calls"] == want, r
