"""Hyper-connections (DeepSeek-V4: a `[B, S, hc_mult, D]` residual stream across stage boundaries, `hc_head` before
the final norm), token ids on every stage (DeepSeek-V4's hash-routed MoE layers), per-layer configs (Gemma 4: `head_dim`
per layer through `config.per_layer_config[i]`) and per-layer inputs (Gemma 4's, packed beside the hidden state across
stage boundaries; with its MoE blocks at pp2 x ep2 too), exact against the model's own run (fp32: loss, every full
gradient, parameters after each AdamW step, two in the first case of each layout, the other cases of one family
sharing the references' step; tests/hf_utils.py's lockstep case), and what cannot be given exactly refused in
one line.

DeepSeek-V4 runs at pp2 x ep2 (experts split over ep, FSDP over dp_shard 2) and at pp2 x tp2: its declared TP plan
splits only the experts, so its shared-KV MQA attention (one KV head, which no TP degree divides) runs whole on every TP
rank and the preflight's head check, which holds only where the plan splits attention, lets it pass. Its hash-routed
layers route by `tid2eid[input_ids]`, all zeros at init (every token to expert 0, whatever
its id): the hash-routed case fills the table so that the route depends on the id, and puts a hash-routed layer on
each stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import transformers as T
from hf_utils import BASE, assert_exact, family, run_families
from test_hf_families import _preflight
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.models.hf.extras import after_embed, after_head
from pp_tp.models.hf.layout import _dims
from pp_tp.models.hf.small import small_config

GEMMA4 = dict(  # over test_hf_families.BASE
    head_dim=8,
    global_head_dim=16,  # full-attention layers: twice the sliding layers' head_dim, a per-layer value
    hidden_size_per_layer_input=8,  # per-layer inputs: [B, S, 4 layers, 8] packed beside the hidden state
    vocab_size_per_layer_input=BASE["vocab_size"],
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention"] * 2,
)
FAMILIES = {
    "deepseek_v4_score_routed": family("deepseek_v4", "eager", mlp_layer_types=["moe"] * 4),
    "deepseek_v4_hash_routed": family("deepseek_v4", "eager", mlp_layer_types=["moe", "hash_moe"] * 2),
    "gemma4_per_layer_head_dim": family(T.Gemma4TextConfig, **GEMMA4),
    # Gemma 4's MoE blocks (its 26B-A4B form): a router and experts beside the dense MLP in every layer
    "gemma4_moe": family(
        T.Gemma4TextConfig, **GEMMA4, enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32
    ),
    # a parameterless norm the forward runs before its layers too; logits softcapped
    "nanochat_norm_before_layers": family("nanochat"),
    # a causal mask although its config sets a window
    "moshi_causal_mask": family("moshi", sliding_window=4),
}
CASES = [
    ("deepseek_v4_score_routed", dict(pp=2, dp_shard=2, ep=2, schedule="1F1B", microbatches=2, steps=1)),
    ("gemma4_per_layer_head_dim", dict(pp=2, tp=2, schedule="1F1B", microbatches=2, steps=1)),
    ("nanochat_norm_before_layers", dict(pp=2, tp=2, schedule="1F1B", microbatches=2, steps=1)),
    ("moshi_causal_mask", dict(pp=2, dp_shard=2, schedule="1F1B", microbatches=2, steps=1)),
    ("deepseek_v4_hash_routed", dict(pp=2, dp_shard=2, ep=2, schedule="1F1B", microbatches=2)),
    # attention whole, TP experts
    ("deepseek_v4_score_routed", dict(pp=2, tp=2, schedule="1F1B", microbatches=2, steps=1)),
    # per-layer inputs beside EP
    ("gemma4_moe", dict(pp=2, dp_shard=2, ep=2, schedule="1F1B", microbatches=2, steps=1)),
]


@contextlib.contextmanager
def _hash_table() -> Iterator[None]:
    """DeepSeek-V4's hash routers with a table whose route depends on the token id (token t: experts 3t + j mod E)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as V4

    init = V4.DeepseekV4PreTrainedModel._init_weights

    def filled(self, module):
        init(self, module)
        if isinstance(module, V4.DeepseekV4HashRouter):
            t, j = torch.arange(module.tid2eid.shape[0])[:, None], torch.arange(module.tid2eid.shape[1])
            with torch.no_grad():
                module.tid2eid.copy_((3 * t + j) % module.num_experts)

    V4.DeepseekV4PreTrainedModel._init_weights = filled
    try:
        yield
    finally:
        V4.DeepseekV4PreTrainedModel._init_weights = init


def _run(cases: list[tuple[str, dict]]) -> list[dict]:
    with _hash_table():
        return run_families([(FAMILIES[name], kw) for name, kw in cases])


def test_hyper_connections_and_per_layer_head_dims_are_exact(world):
    assert_exact(world(4).run(_run, CASES), CASES)


def test_the_stream_crosses_the_boundary_whole_and_hc_head_runs_last():
    model = FAMILIES["deepseek_v4_score_routed"].make("meta")
    layout = layout_for(model)
    assert layout.last.modules == ("model.hc_head", "model.norm", "lm_head") and "model.hc_head" not in layout.shared
    assert layout.dims(model).streams == 4
    assert not layout.block_ids  # no layer routes by the ids: later stages are not handed them
    h = torch.randn(2, 3, 32)
    assert torch.equal(after_embed(model.config)(h), h.unsqueeze(2).expand(-1, -1, 4, -1))


def test_per_layer_dims_divide_every_layer():
    """Gemma 4's head_dim 8 / 16 per layer: the dims hold their common divisor, so TP checks hold per layer."""
    dims = _dims(FAMILIES["gemma4_per_layer_head_dim"].make("meta"))
    assert (dims.n_heads, dims.n_kv_heads, dims.head_dim) == (4, 2, 8)
    assert dims.streams == 2  # the hidden state, then 4 layers x 8 per-layer input values in one stream of 32
    small = small_config(CONFIG_MAPPING["gemma4_text"]())
    assert [c.head_dim for c in small.per_layer_config] == [16, 32]  # default 256 / 512, shrunk alike


def test_tp_divisibility_is_checked_per_layer():
    """One KV head on the full-attention layers only (Gemma 4's `num_global_key_value_heads`): refused at tp 2."""
    config = T.Gemma4TextConfig(**{**BASE, **GEMMA4, "attention_k_eq_v": True, "num_global_key_value_heads": 1})
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match=r"model.n_kv_heads = 1 is not divisible by parallel.tp = 2"):
        _preflight(model, pp=2, tp=2)


def test_heads_need_divide_tp_only_where_the_plan_splits_attention():
    """DeepSeek-V4's one KV head passes at tp 2 (its plan leaves attention whole: no head split, no KV heads to
    divide); a Llama with one KV head, whose plan splits k_proj by rows, is refused (a split would cut the head)."""
    _preflight(FAMILIES["deepseek_v4_score_routed"].make("meta"), pp=2, tp=2)
    with torch.device("meta"):
        llama = T.LlamaForCausalLM(T.LlamaConfig(**{**BASE, "num_key_value_heads": 1}))
    with pytest.raises(ConfigError, match=r"model.n_kv_heads = 1 is not divisible by parallel.tp = 2"):
        _preflight(llama, pp=2, tp=2)


@pytest.mark.parametrize(
    "model_type, extra, match",
    [
        ("gemma3n_text", {}, r"model.altup_projections holds weights outside embedding/layers/norm"),
        ("gemma4_text", dict(hidden_size_per_layer_input=0, num_kv_shared_layers=2), r"num_kv_shared_layers = 2"),
        ("hy_v4", {}, r"hands each layer the previous layer's 'topk_indices' \(as 'prev_topk_indices'\)"),
        ("zaya", {}, r"hands each layer the previous layer's 'prev_router_hidden_states' \(as 'argument 2'\)"),
    ],
)
def test_what_a_layer_cannot_be_handed_is_refused_in_one_line(model_type, extra, match):
    config = small_config(CONFIG_MAPPING[model_type](**extra))
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match=match) as e:
        layout_for(model)
    assert "\n" not in str(e.value)


def test_an_aliased_config_key_is_not_read_as_the_extra_it_names():
    """Inkling's `attribute_map` makes `embedding_multiplier` read `logits_mup_width_multiplier` (24), which its
    forward divides the last hidden state by: no embedding scale, the logits divided by 24 (a bias-free head)."""
    config = CONFIG_MAPPING["inkling_text"]()
    assert config.embedding_multiplier == 24.0 and after_embed(config) is None
    x = torch.randn(2, 3, 8)
    assert torch.equal(after_head(config)(x), x / 24.0)
    granite = T.GraniteConfig(embedding_multiplier=12.0, logits_scaling=8.0)
    assert torch.equal(after_embed(granite)(x), x * 12.0) and torch.equal(after_head(granite)(x), x / 8.0)


@pytest.mark.parametrize("model_type", ["doge", "lara_mini", "bailing_hybrid", "inkling_text", "moshi", "nanochat"])
def test_what_the_forward_hands_its_layers_is_taken_from_it(model_type):
    """Doge's materialized mask, LaraMini's layers without rotary tables, Bailing's rotary tables through **kwargs,
    Inkling's causal masks for its hybrid layers: the self-check proves each composition equal (1e-5) to the
    family's own forward on its small copy, so the layout is given."""
    config = small_config(CONFIG_MAPPING[model_type]())
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(config)
    assert layout_for(model).blocks == "model.layers"


def test_a_flat_stream_is_carried_viewed_and_handed_to_each_layer_flat():
    from types import SimpleNamespace

    from pp_tp.models.hf import hyper

    config = SimpleNamespace(hc_count=3)  # Qwen4-Exp's form: the embedding repeated along the hidden axis
    assert hyper.streams(config) == 3 and hyper.flat(config) and not hyper.flat(SimpleNamespace(hc_mult=3))
    h = torch.randn(2, 5, 4)
    flat = after_embed(config)(h)
    assert torch.equal(flat, h.repeat(1, 1, 3))
    seen = []
    call = hyper.flat_call(lambda block, x, extras, index: seen.append(x.shape) or x * 2, 3)
    out = call(None, call(None, flat, (), 0), (), 1)  # first layer after the embedding, then one after a boundary
    assert seen == [(2, 5, 12), (2, 5, 12)] and out.shape == (2, 5, 3, 4)
    assert torch.equal(hyper.flatten(out), flat * 4)
