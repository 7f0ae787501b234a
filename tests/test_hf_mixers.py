"""Hugging Face families whose blocks mix beyond softmax attention (gated-delta-net and KDA linear attention, Mamba,
DeepSeek-V3.2's sparse-attention indexer): exact at pp2 x tp2 (gated delta nets and Mamba2 split by heads,
parallel/mixer_tp.py; the mixers no head-split record fits running whole on every TP rank), MoE ones at pp2 x ep2, or
refused in one line.

Each family is its own default config shrunk by the self-check's rule (4 layers cycling its per-layer lists), checked in
lockstep against the model's own run exactly as tests/test_hf_families.py checks the softmax families (loss, every full
gradient, parameters after each AdamW step, buffers), through tests/hf_utils.py's `family_case`: two steps in the
first case of each layout (the optimizer state carried), one in the others, whose TP and EP cases of one family share
the references' step.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T
from hf_utils import assert_exact, family, run_families
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.models.hf.small import small_config

MIXERS = (
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "kimi_linear",
    "deepseek_v32",
    "jamba",
    "nemotron_h",
    "axk2",
    "glm_moe_dsa",
)
# Each one's default config shrunk by the self-check's rule, 4 layers cycling its per-layer lists (layer types, MLP
# types); Bamba's default stack has no attention layer: one makes it hybrid.
FAMILIES = {name: family(name, per_layer="lists") for name in MIXERS}
FAMILIES["bamba"] = family("bamba", per_layer="lists", attn_layer_indices=[1])

TP = dict(pp=2, tp=2, schedule="1F1B", microbatches=2, steps=1)
EP = dict(pp=2, dp_shard=2, ep=2, schedule="1F1B", microbatches=2, steps=1)
CASES = [
    ("qwen3_next", TP),  # gated-delta-net, attention heads and TP experts split
    ("qwen3_next", EP),  # gated delta nets beside attention, experts over 2 EP ranks, shared expert gated
    ("qwen3_5_text", dict(pp=2, tp=2, schedule="ZBVZeroBubble", microbatches=4)),
    ("kimi_linear", TP),  # KDA whole, MLA heads split
    ("deepseek_v32", TP),  # MLA heads split, the indexer whole beside the latents
    ("deepseek_v32", EP),  # the indexer's top-k per EP rank's own tokens, experts over 2 EP ranks
    ("glm_moe_dsa", dict(EP, steps=2)),  # each layer handed the previous one's top-k indices, read by none: not carried
    ("axk2", TP),  # as V3.2, q_gate_proj reading [q_resid, q_compressed]: its input gradient left partial
    ("jamba", TP),  # Mamba whole, TP experts
    ("jamba", EP),  # experts over 2 EP ranks; uneven padding across dp
    ("nemotron_h", EP),  # Mamba2, attention, MLP and MoE blocks
    ("nemotron_h", TP),  # non-gated experts (up_proj, relu2, down_proj) split on their hidden dim
    ("qwen3_5_moe_text", EP),  # gated delta nets beside attention, experts over 2 EP ranks
    ("qwen3_5_moe_text", TP),  # gated delta nets split by heads, TP experts
    # Mamba2 split by heads (2 groups, one per TP rank); attention and MLP, unplanned, whole
    ("bamba", dict(TP, steps=2)),
]


def test_mixer_families_match_their_own_forward(world):
    assert_exact(world(4).run(run_families, [(FAMILIES[name], kw) for name, kw in CASES]), CASES)


def test_a_handed_on_value_no_layer_reads_is_not_carried():
    """GLM-MoE-DSA's forward hands each layer the previous layer's top-k indices; with every layer's own indexer
    (its default) no layer's output depends on them, so pp_tp runs it without them (its pp2 x ep2 case is in CASES);
    with a shared-indexer layer, which reads them, it is refused in one line."""
    from pp_tp.models.hf.threaded import unread

    def model(**kw):
        with torch.device("meta"):
            return T.AutoModelForCausalLM.from_config(small_config(CONFIG_MAPPING["glm_moe_dsa"](**kw)))

    assert unread(model(), "layers", "prev_topk_indices")
    shared = dict(num_hidden_layers=4, indexer_types=["full", "shared"] * 2, mlp_layer_types=["dense"] * 4)
    assert not unread(model(**shared), "layers", "prev_topk_indices")
    with pytest.raises(ConfigError, match=r"hands each layer the previous layer's 'topk_indices'") as e:
        layout_for(model(**shared))
    assert "\n" not in str(e.value)


def test_an_unknown_layer_type_is_refused_in_one_line():
    config = small_config(T.Qwen3NextConfig())
    config.layer_types = ["linear_attention", "telepathic_attention"]
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match=r"Qwen3NextForCausalLM: config.layer_types has 'telepathic_attention'") as e:
        layout_for(model)
    assert "\n" not in str(e.value)


def test_the_report_names_what_runs_whole_on_every_tp_rank():
    """Qwen3-Next's gated-delta-net is split by heads (parallel/mixer_tp.py) and not named; Jamba's Mamba mixer (no
    head-split record fits it) and DeepSeek-V3.2's indexer (beside MLA's latents) are, with their parameter counts;
    split attention and experts are not."""
    from pp_tp.parallel.whole_on_tp import whole_in_blocks

    def whole(name: str) -> dict:
        model = FAMILIES[name].make("meta")
        layout = layout_for(model)
        return whole_in_blocks(model.get_submodule(layout.blocks).children(), layout)

    qwen = whole("qwen3_next")
    assert not any(k.startswith(("linear_attn", "self_attn", "mlp.experts")) for k in qwen), qwen
    jamba = FAMILIES["jamba"].make("meta")
    mamba = sum(p.numel() for b in jamba.model.layers if hasattr(b, "mamba") for p in b.mamba.parameters())
    assert whole("jamba")["mamba"] == (("JambaMambaMixer",), mamba)
    dsa = whole("deepseek_v32")
    assert "self_attn.indexer" in dsa and "self_attn.q_b_proj" not in dsa and "mlp.experts" not in dsa, dsa


def test_the_small_copy_keeps_sub_configs_tied_as_the_config_derives_them():
    """BLT's shrunk sub-configs stay consistent: its own __post_init__ re-derives the global transformer's input
    projection (encoder width x cross_attn_k = 128 into a 64-wide global transformer) and the local encoder's window."""
    small = small_config(T.BltConfig())
    width = small.encoder_config.hidden_size * small.cross_attn_k
    assert (width, small.global_config.hidden_size) == (128, 64)
    assert small.global_config.encoder_cross_output_size == width
    assert small.encoder_config.sliding_window == small.local_attention_window_len == 4
