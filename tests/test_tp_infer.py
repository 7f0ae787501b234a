"""Tensor parallelism for Hugging Face families that declare no TP plan (pp_tp/models/hf/tp_infer.py).

The Megatron pairs are inferred from each block's modules and proven on a shrunk copy at tp = 2 (two copies of the
block with one TP rank's shards each, the row-parallel outputs summed, against the whole block); what no candidate
proves runs whole on every TP rank. Checked here: the plans inferred for GPT-2 (Conv1D, fused [q|k|v] split per
part), BLOOM (per-head interleaved fused q/k/v, ALiBi sliced with its heads), BitNet (a norm between each pair:
whole) and Mamba (no pair: whole, and no head count to check); a wrong split of GPT-2's fused projection fails the
proof; and GPT-2, OPT, BLOOM, MPT (ALiBi) and StableLM train exactly at pp2 x tp2 (the float64
verdict of tests/hf_utils.py's parity case).
"""

from __future__ import annotations

import hf_utils as hu
import torch
from hf_utils import family

from pp_tp.models.hf import tp_infer
from pp_tp.models.hf.layout import compose
from pp_tp.models.hf.record import record_of
from pp_tp.parallel.tp_proof import call_order
from pp_tp.parallel.whole_on_tp import splits_attention

# model type -> its tiny build (the default config shrunk by the self-check's rule, dropout off: two builds draw
# different masks)
FAMILIES = {
    "gpt2": family("gpt2", attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0),
    "opt": family("opt", dropout=0.0),
    "bloom": family("bloom", "eager"),  # ALiBi: `alibi` [batch * heads, 1, seq]
    "mpt": family("mpt", "eager"),  # ALiBi: `position_bias` [heads, 1, seq], fused [q|k|v]
    "stablelm": family("stablelm"),
}
PP2_TP2 = dict(pp=2, tp=2, schedule="1F1B", microbatches=2)
CASES = [(name, PP2_TP2 if name == "gpt2" else dict(PP2_TP2, steps=1)) for name in FAMILIES]  # 2 AdamW steps: GPT-2


def _plan(name: str) -> dict[str, str]:
    return compose(FAMILIES[name].make("meta", layers=2)).tp_plan


def test_inferred_pairs_of_conv1d_fused_alibi_and_unsplittable_families():
    gpt2 = _plan("gpt2")
    assert gpt2["attn.c_attn"] == "conv1d_colwise_packed3" and gpt2["attn.c_proj"] == "conv1d_rowwise", gpt2
    assert gpt2["mlp.c_fc"] == "conv1d_colwise" and gpt2["attn"] == "local_heads", gpt2
    bloom = _plan("bloom")
    assert bloom["self_attention.query_key_value"] == "colwise", bloom  # whole heads, each with its q, k and v
    assert bloom["self_attention"] == "local_heads:alibi", bloom
    assert _plan("mpt")["attn"] == "local_heads:position_bias"
    bitnet = compose(family("bitnet").make("meta", layers=2)).tp_plan  # sub-norms between each pair
    assert bitnet == {"mlp": "replicate", "self_attn": "replicate"}, bitnet
    # x_proj reads the inner width: no pair; and no head count to divide
    mamba = family("mamba", "eager", per_layer="lists").make("meta", layers=2)
    layout = compose(mamba)
    assert layout.tp_plan == {"mixer": "replicate"} and not splits_attention(mamba, layout), layout.tp_plan


def test_a_wrong_split_of_a_fused_projection_fails_the_proof():
    record = record_of(FAMILIES["gpt2"].make("meta", layers=2))
    model = record.copy()  # the family's small copy, and what its own forward handed its blocks
    blocks = list(model.transformer.h)
    block, inputs = blocks[0], tp_infer._block_inputs(record, "transformer.h", len(blocks))[0]
    order, want = call_order(block, *inputs)
    attn = next(
        r for r in tp_infer._regions(order, tp_infer._layers(block), model.config.hidden_size) if r.tops == ("attn",)
    )
    right = {"parts": {"attn.c_attn": 3}, "local": {"attn": ()}}
    assert tp_infer._proven(block, inputs, want, [(attn, right)])
    for wrong in ({**right, "parts": {"attn.c_attn": 1}}, {**right, "local": {}}):  # plain Shard(0); global heads
        assert not tp_infer._proven(block, inputs, want, [(attn, wrong)]), wrong
    assert torch.equal(want, call_order(block, *inputs)[1])  # the proof left the block as it was


def run_cases(cases: list[tuple[str, dict]]) -> list[dict]:
    return hu.run_families([(FAMILIES[name], kw) for name, kw in cases])


def test_no_plan_families_exact_at_pp2_tp2(world):
    hu.assert_exact(world(4).run(run_cases, CASES), CASES)
