"""Hugging Face causal LMs that declare no `base_model_pp_plan`: structure found from their own forward
(pp_tp/models/hf/discover.py: through wrappers such as BERT's `encoder`, with no final norm, with ALiBi biases the
family's own code computes per microbatch shape; RWKV, whose forward threads a state from layer to layer only with a
cache; CTRL, whose forward scales its embeddings and adds sinusoidal positions in its own code), exact against the
model's own run, or refused in one line; Llama 4 (text); and
randomness beyond dropout in a family's training forward (pp_tp/models/hf/randomness.py), accepted
outside TP regions.

Tiny configs built here, fp32. Exactness: loss, every full gradient and the parameters after each AdamW step (two in the
first case of each layout, one in the others) against the model's own run, in lockstep (pp_tp/parity/lockstep.py, the
float64 verdict), all cases in one 4-rank world.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers as T
from hf_utils import VOCAB, Family, assert_exact, run_families

import pp_tp
from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.models.hf.discover import EmbedCall

IDS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
BASE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, **IDS,
)  # fmt: skip
OPT = dict(
    hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64,
    word_embed_proj_dim=32, dropout=0.0,
)  # fmt: skip
MPT = dict(d_model=32, n_heads=4, n_layers=4, expansion_ratio=2, max_seq_len=64, resid_pdrop=0.0, emb_pdrop=0.0)
BERT = dict(
    hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, is_decoder=True,
)  # fmt: skip
RWKV = dict(hidden_size=32, num_hidden_layers=4, attention_hidden_size=32, intermediate_size=64, context_length=64)
CONFIGS = {
    "gpt2": lambda **kw: T.GPT2Config(
        n_embd=32, n_layer=4, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **IDS, **kw
    ),
    "opt": lambda **kw: T.OPTConfig(**{**OPT, **IDS, **kw}),
    "bloom": lambda **kw: T.BloomConfig(
        **{**dict(hidden_size=32, n_layer=4, n_head=4, hidden_dropout=0.0, attention_dropout=0.0), **IDS, **kw}
    ),
    "mpt": lambda **kw: T.MptConfig(**{**MPT, **IDS, **kw}),
    "bert-generation": lambda **kw: T.BertGenerationConfig(**{**BERT, **IDS, **kw}),
    "openai-gpt": lambda **kw: T.OpenAIGPTConfig(
        n_embd=32, n_layer=4, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **IDS, **kw
    ),
    "xlnet": lambda **kw: T.XLNetConfig(d_model=32, n_layer=2, n_head=4, d_inner=64, **IDS, **kw),
    "llama4_text": lambda **kw: T.Llama4TextConfig(
        **BASE, intermediate_size_mlp=64, head_dim=8, num_local_experts=4, attention_chunk_size=4, **kw
    ),
    "phimoe": lambda **kw: T.PhimoeConfig(**BASE, num_local_experts=4, **kw),
    "rwkv": lambda **kw: T.RwkvConfig(**{**RWKV, **IDS, **kw}),
    "mllama": lambda **kw: T.MllamaConfig(  # text alone: its forward skips the cross-attention layers 1, 2, 3
        text_config={**BASE, "cross_attention_layers": [1, 2, 3], **kw}
    ),
    "ctrl": lambda **kw: T.CTRLConfig(
        n_embd=32, n_layer=2, n_head=4, dff=64, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, **IDS, **kw
    ),
}


def _config(name: str, kw: dict, layers: int):
    """CONFIGS[name] with `kw`; each sets its own depth (`layers` is left to it)."""
    return CONFIGS[name](**kw)


def family(name: str, **kw) -> Family:
    return Family(functools.partial(_config, name, kw), attn=None)


def make(name: str, device: str = "cpu", **kw) -> torch.nn.Module:
    return family(name, **kw).make(device)


def one_line(name: str, match: str, **kw) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        layout_for(make(name, "meta", **kw))
    assert "\n" not in str(e.value)


def test_gpt2_and_opt_structures_are_found_from_their_forward():
    gpt2 = layout_for(make("gpt2", "meta"))
    assert (gpt2.first.modules, gpt2.blocks, gpt2.last.modules) == (
        ("transformer.wte", "transformer.wpe", "transformer.drop"),
        "transformer.h",
        ("transformer.ln_f", "lm_head"),
    )
    assert isinstance(gpt2.first.call, EmbedCall)  # learned positions: the forward's own path, not the modules in turn
    # no TP plan declared: its Megatron pairs inferred and proven (tests/test_tp_infer.py), so tp > 1 is not refused
    assert gpt2.tp_refusal is None and gpt2.tp_plan["attn.c_proj"] == "conv1d_rowwise", (gpt2.tp_refusal, gpt2.tp_plan)
    opt = layout_for(make("opt", "meta"))
    assert (opt.first.modules, opt.blocks, opt.last.modules[0]) == (
        ("model.decoder.embed_tokens", "model.decoder.embed_positions"), "model.decoder.layers",
        "model.decoder.final_layer_norm")  # fmt: skip


def test_the_gpt2_first_stage_adds_learned_positions_as_its_forward_does():
    from pp_tp.split.plan import StageSpec
    from pp_tp.stages.stage_module import StageModule

    torch.manual_seed(0)
    model = make("gpt2").eval()
    lay = layout_for(model)
    first = StageModule(model, lay, StageSpec(0, 0, True, [], False, list(lay.first.modules)))
    ids = torch.randint(0, VOCAB, (2, 8))
    want = model.transformer.wte(ids) + model.transformer.wpe(torch.arange(8))
    assert torch.equal(first(ids), want)
    shifted = torch.arange(8).unsqueeze(0) + 3  # packed documents' positions reach the position embedding
    assert torch.equal(first(ids, shifted), model.transformer.wte(ids) + model.transformer.wpe(shifted))


def test_structures_it_cannot_prove_are_refused_in_one_line():
    one_line("xlnet", r"XLNetLMHeadModel: its forward calls dropout more than once")  # two-stream, before collectives
    one_line("opt", r"runs \['final_layer_norm', 'project_out'\] after its layers", word_embed_proj_dim=16)


def test_layers_the_forward_skips_are_found_by_their_class():
    """Mllama on text alone skips its cross-attention layers: found on the small copy by class, carried to the full
    model's indices; a stage passes the hidden state through them unchanged."""
    from pp_tp.models.hf.handed import handed
    from pp_tp.models.hf.skipped import skipped_layers

    model = make("mllama", "meta", num_hidden_layers=6, cross_attention_layers=[1, 4])
    assert skipped_layers(model, "layers", handed(model, "layers")) == {1, 4}
    lay = layout_for(model)
    h = torch.randn(2, 3, 32)
    assert lay.call_block(model.model.layers[4], h, (), 4) is h


def _first_layer_input(model: torch.nn.Module, blocks: str, ids: torch.Tensor, positions: torch.Tensor | None):
    """What the model's own forward hands its first layer."""
    seen = []
    hook = model.get_submodule(blocks)[0].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions, use_cache=False)
    hook.remove()
    return seen[0]


def test_the_ctrl_first_stage_replays_its_forwards_scale_and_sinusoidal_positions():
    """CTRL scales its embeddings by sqrt(d) and adds a sinusoidal table in its own code, not in a module: the first
    stage replays that code (pp_tp/models/hf/prologue.py), bit for bit, packed documents' positions included."""
    from pp_tp.split.plan import StageSpec
    from pp_tp.stages.stage_module import StageModule

    torch.manual_seed(0)
    model = make("ctrl").eval()
    lay = layout_for(model)
    assert (lay.first.modules, lay.blocks) == (("transformer.w", "transformer.dropout"), "transformer.h")
    first = StageModule(model, lay, StageSpec(0, 0, True, [], False, list(lay.first.modules)))
    ids = torch.randint(0, VOCAB, (2, 8))
    for positions in (None, torch.arange(8).repeat(2, 1) % 5 + 3):
        with torch.no_grad():
            got = first(ids, positions)
        assert torch.equal(got, _first_layer_input(model, lay.blocks, ids, positions))


def test_the_modules_between_base_model_and_head_are_found_from_the_forward():
    """ModernBERT-decoder runs a prediction head (dense, activation, norm) between its final norm and its decoder
    Linear (pp_tp/models/hf/head_path.py); GPT-2 runs nothing there."""
    from pp_tp.models.hf.head_path import before_head

    config = T.ModernBertDecoderConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, **IDS)  # fmt: skip
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(config)
    assert before_head(model) == ("lm_head",)
    assert before_head(make("gpt2", "meta")) == ()


def test_wrapped_layers_no_final_norm_and_alibi_are_found():
    bert = layout_for(make("bert-generation", "meta"))
    assert (bert.embed, bert.blocks) == ("bert.embeddings.word_embeddings", "bert.encoder.layer")
    assert bert.last.modules == ("lm_head.decoder",)  # no final norm: the head right after the layers
    assert layout_for(make("openai-gpt", "meta")).last.modules == ("lm_head",)
    bloom = layout_for(make("bloom", "meta", n_head=8))
    assert bloom.document_block_inputs is None  # biases from the batch's shape: packed documents refused


def test_alibi_is_what_the_family_computes_for_the_models_own_head_count():
    from transformers.models.bloom.modeling_bloom import BloomModel

    model = make("bloom", "meta", n_head=8)  # 8 heads; the discovery copy has 4
    h = torch.zeros(3, 5, 32, dtype=torch.bfloat16)
    computed = layout_for(model).block_inputs(None, h)[3]
    want = BloomModel.build_alibi_tensor(None, torch.ones(3, 5), 8, torch.bfloat16)
    assert computed["alibi"].dtype == torch.bfloat16 and torch.equal(computed["alibi"], want)


def test_llama4_text_gets_a_layout_with_chunked_attention():
    lay = layout_for(make("llama4_text", "meta"))
    assert (lay.first.modules, lay.blocks, lay.last.modules) == (("model.embed_tokens",), "model.layers",
                                                                 ("model.norm", "lm_head"))  # fmt: skip


def test_router_noise_outside_sharded_regions_is_accepted():
    """PhiMoE's sparsemixer draws on the replicated hidden state (pp_tp/models/hf/randomness.py): TP stays allowed."""
    assert layout_for(make("phimoe", "meta")).tp_refusal is None
    assert layout_for(make("phimoe", "meta", router_jitter_noise=0.0)).blocks == "model.layers"


DP2 = dict(pp=2, dp_shard=2, schedule="1F1B", microbatches=2)
ONE = dict(DP2, steps=1)  # one AdamW step; two in GPT-2's case (tests/hf_utils.py `family_case`)
CASES = [
    ("gpt2", DP2, {}),
    ("opt", dict(ONE, schedule="Interleaved1F1B"), {}),
    ("llama4_text", ONE, {}),
    ("phimoe", dict(pp=2, tp=2, schedule="1F1B", microbatches=2, steps=1), dict(router_jitter_noise=0.0)),
    ("bloom", ONE, {}),  # ALiBi computed per microbatch by BLOOM's own code
    ("mpt", ONE, {}),  # ALiBi as position_bias, its mask handed to layers as bool
    ("bert-generation", ONE, {}),  # embeddings and layers inside wrappers, no final norm
    ("rwkv", ONE, {}),  # its forward threads a `state` from layer to layer only with a cache: None in training
    ("ctrl", ONE, {}),  # its scale and sinusoidal positions in its own code, replayed by the first stage
    ("mllama", ONE, {}),  # cross-attention layers skipped on text alone: stage 1 holds only skipped ones; grads None
]


def test_families_without_a_pp_plan_match_their_own_run(world):
    cases = [(family(name, **config), kw) for name, kw, config in CASES]
    assert_exact(world(4).run(run_families, cases), [(name, kw) for name, kw, _ in CASES])


def test_beam_full_layers_get_their_query_scale_from_the_position_ids():
    """Beam's forward hands its NoPE full-attention layers `attention_scaling` from the position ids (None to its
    sliding ones): the block context computes it by the family's own forward, packed positions included."""
    from transformers.models.beam.modeling_beam import compute_attention_scaling

    from pp_tp.models.hf.block_context import layer_types_of
    from pp_tp.models.hf.discover import SUPPLIED
    from pp_tp.models.hf.handed import handed
    from pp_tp.models.hf.position_args import position_args

    model = T.BeamForCausalLM(pp_tp.models.hf.small.small_config(T.BeamConfig(**IDS)))
    found = handed(model, "layers")
    types = layer_types_of(found.config, len(found.layers))
    stand_in, keys = position_args(model, found, types, set(SUPPLIED))
    assert keys == ("attention_scaling",)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    got = stand_in(packed, 2, torch.float32)
    assert got["sliding_attention"]["attention_scaling"] is None
    assert torch.equal(got["full_attention"]["attention_scaling"], compute_attention_scaling(packed))
