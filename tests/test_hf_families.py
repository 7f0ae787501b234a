"""Hugging Face decoder families through the generic layout: exact against the model's own forward, or refused.

Tiny configs built here (no downloads), fp32. Each case builds the model on CPU with random weights, runs its
own forward + backward (mean token cross-entropy) and two AdamW steps, and the pipelined build (pp2 x tp2,
some with dp2 and uneven padding) on the same weights and batch, in lockstep (pp_tp/parity/lockstep.py): after every
step the loss, every full gradient (a tied copy against the tied weight's gradient), every parameter and the
persistent buffers, relative error <= 1e-5.
"""

from __future__ import annotations

import hf_utils as hu
import parity_utils as pu
import pytest
import torch
import transformers as T
from hf_utils import BASE, SEQ, VOCAB, family

import pp_tp
from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.models.reference.model import ModelArgs
from pp_tp.preflight import PreflightInputs, preflight


def _sliding(**kw) -> dict:
    return {"sliding_window": 4, **kw}


# name -> its tiny build (tests/hf_utils.py: a config class over BASE, or the model type's default config shrunk)
FAMILIES = {
    "reference_tied": family("reference", tie_embeddings=True),  # pp_tp's own Transformer ties the same way
    "llama_tied": family(T.LlamaConfig, tie_word_embeddings=True),
    "llama": family(T.LlamaConfig, tie_word_embeddings=False),
    "qwen2_tied_bias": family(T.Qwen2Config, tie_word_embeddings=True),
    "qwen3": family(T.Qwen3Config, head_dim=8, tie_word_embeddings=False),
    "mistral_sliding": family(T.MistralConfig, **_sliding()),
    "gemma_tied_scaled": family(T.GemmaConfig, head_dim=8),
    "gemma2_softcap": family(T.Gemma2Config, "eager", **_sliding(head_dim=8)),
    "gemma3_alternating": family(T.Gemma3TextConfig, **_sliding(head_dim=8, sliding_window_pattern=2)),
    "granite": family(
        T.GraniteConfig, embedding_multiplier=3.0, logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.3
    ),
    "phi3_fused": family(T.Phi3Config),  # GQA: q/k/v parts differ, so qkv_proj stays gathered
    "phi3_mha": family(T.Phi3Config, num_key_value_heads=4),  # qkv_proj split per part too
    "olmo2_fullwidth_norm": family(T.Olmo2Config),
    "mixtral_moe": family(T.MixtralConfig, num_local_experts=4, num_experts_per_tok=2),
    # families no issue named
    "smollm3_nope_layers": family(T.SmolLM3Config, tie_word_embeddings=True),
    "cohere2_sliding": family(T.Cohere2Config, **_sliding()),
    "qwen2_window_layers": family(T.Qwen2Config, **_sliding(use_sliding_window=True, max_window_layers=2)),
    "qwen3_moe": family(T.Qwen3MoeConfig, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "qwen3_moe_odd_width": family(T.Qwen3MoeConfig, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=17),
    # families with persistent buffers (router biases, activation constants) or MLA, from their own default
    # config shrunk by the self-check's rule (tests/test_buffers.py)
    "glm4_moe": family("glm4_moe"),
    "deepseek_v3": family("deepseek_v3"),
    "deepseek_v2": family("deepseek_v2", first_k_dense_replace=1),
    "minicpm3": family("minicpm3"),
    # its default's first layer dense, the rest MoE (so every rank holds router biases under ZBV, tests/test_buffers.py)
    "exaone_moe": family("exaone_moe", mlp_layer_types=["dense"] + ["sparse"] * 3),
    "dots1": family("dots1"),
    "minimax_m2": family("minimax_m2"),
    "apertus": family("apertus"),
    "llama4_text": family("llama4_text"),  # experts [E, D, 2F], called densely, declared in the TP plan only
    "olmoe": family("olmoe"),  # no declared pp plan: embed_tokens -> layers -> norm
    "qwen2_moe": family("qwen2_moe"),
    "gpt_oss": family("gpt_oss", "eager"),
    "granite_swa_sinks": family("granite_swa", "eager"),  # HF's `local_params` attention: sinks split by heads
    "doge": family("doge"),  # per-head `A` of its own in the attention; MoE rules naming nothing (MoE off)
}


def make(name: str, device: str = "cpu", layers: int = 4) -> torch.nn.Module:
    """A family of this module's table (other modules read it: test_buffers, test_expert_parallel, ...)."""
    return FAMILIES[name].make(device, layers)


def run_all(cases: list[tuple[str, dict]]) -> list[dict]:
    """Every (family, parallel keys) case of this module's table on this rank (tests/hf_utils.py's parity case)."""
    return hu.run_families([(FAMILIES[name], kw) for name, kw in cases])


assert_exact = hu.assert_exact

TP = dict(tp=2, embedding="vocab_parallel")
# (family, layout) pairs: pp2 x tp2 across 1F1B, an interleaved and a V schedule; some with dp2 and padding.
# Tied families without `embedding` run on the default ("auto": vocab-parallel because they tie and tp > 1). Families
# whose paths these cover (Mistral's sliding window, Cohere, StarCoder2, Qwen3-MoE) run in bench/family_sweep.py.
# `steps=1`: one AdamW step, two in another case of the layout kind (tests/hf_utils.py `family_case`); a family's
# one-step cases share the references' step.
CASES4 = [
    ("llama_tied", dict(pp=2, schedule="ZBVZeroBubble", microbatches=4, **TP)),  # one rank holds both ends
    ("llama", dict(pp=2, schedule="Interleaved1F1B", microbatches=2, **TP, loss_parallel=True, steps=1)),
    ("qwen2_tied_bias", dict(pp=2, schedule="Interleaved1F1B", microbatches=2, **TP, steps=1)),
    ("qwen3", dict(pp=2, schedule="1F1B", microbatches=2, **TP)),
    ("gemma_tied_scaled", dict(pp=2, schedule="DualPipeV", microbatches=4, tp=2, steps=1)),
    ("reference_tied", dict(pp=2, schedule="Interleaved1F1B", microbatches=2, **TP, steps=1)),
    ("gemma2_softcap", dict(pp=2, schedule="1F1B", microbatches=2, **TP, steps=1)),
    ("gemma3_alternating", dict(pp=2, schedule="Interleaved1F1B", microbatches=2, **TP, steps=1)),
    ("granite", dict(pp=2, schedule="1F1B", microbatches=2, **TP, loss_parallel=True, steps=1)),
    ("phi3_fused", dict(pp=2, schedule="ZBVZeroBubble", microbatches=4, **TP, steps=1)),
    ("phi3_mha", dict(pp=1, dp_shard=2, schedule="1F1B", microbatches=2, **TP)),  # per part, FSDP on dim 1
    ("olmo2_fullwidth_norm", dict(pp=2, schedule="1F1B", microbatches=2, **TP, steps=1)),
    ("mixtral_moe", dict(pp=2, dp_shard=2, schedule="ZBVZeroBubble", microbatches=4)),  # experts whole per rank
    ("smollm3_nope_layers", dict(pp=2, schedule="1F1B", microbatches=2, tp=2)),
    ("cohere2_sliding", dict(pp=2, schedule="Interleaved1F1B", microbatches=2, **TP, steps=1)),
    ("qwen2_window_layers", dict(pp=2, schedule="1F1B", microbatches=2, **TP, steps=1)),
    ("granite_swa_sinks", dict(pp=2, schedule="1F1B", microbatches=2, **TP, steps=1)),
    ("llama4_text", dict(pp=2, schedule="1F1B", microbatches=2, tp=2, steps=1)),  # TP of transposed experts
    ("llama4_text", dict(pp=2, dp_shard=2, ep=2, schedule="1F1B", microbatches=2)),  # EP of dense experts
    ("olmoe", dict(pp=2, schedule="1F1B", microbatches=2, tp=2, steps=1)),
    ("olmoe", dict(pp=2, dp_shard=2, ep=2, schedule="1F1B", microbatches=2, steps=1)),
]
CASES8 = [
    ("llama_tied", dict(pp=2, dp_shard=2, schedule="1F1B", microbatches=2, **TP)),
    ("gemma2_softcap", dict(pp=2, dp_shard=2, schedule="ZBVZeroBubble", microbatches=4, **TP, steps=1)),
    ("granite", dict(pp=2, dp_replicate=2, schedule="Interleaved1F1B", microbatches=2, **TP)),
]


@pytest.fixture(scope="module")
def cases4(world) -> list[list[dict]]:
    """CASES4's per-rank results, run once for the tests that read them."""
    return world(4).run(run_all, CASES4)


def test_families_match_their_own_forward_at_pp2_tp2(cases4):
    assert_exact(cases4, CASES4)


def test_families_match_with_dp2_and_uneven_padding(world):
    assert_exact(world(8).run(run_all, CASES8), CASES8)


def test_v_schedule_puts_both_tied_copies_on_rank_0(cases4):
    assert CASES4[0] == ("llama_tied", dict(pp=2, schedule="ZBVZeroBubble", microbatches=4, **TP))
    assert sorted(r[0]["stages"] for r in cases4) == [[0, 3], [0, 3], [1, 2], [1, 2]]


# --- TP collectives per block ----------------------------------------------------------------------


def _per_block_collectives(name: str) -> dict[tuple[str, str], float]:
    """TP collectives of one block and one microbatch, forward and backward: a 4-layer minus a 2-layer build."""
    from collections import Counter

    from test_tensor_parallel import _CollectiveLog

    pcfg = pu.pcfg_of(tp=2, microbatches=1, **{k: v for k, v in TP.items() if k != "tp"})
    counts = []
    for layers in (2, 4):
        pipe = pp_tp.build_pipeline(make(name, "meta", layers), pp_tp.build_mesh(pcfg), pcfg)
        with _CollectiveLog() as log:
            pipe.step(*pu.batch(ModelArgs(vocab_size=VOCAB), 2, SEQ))
        per_op: Counter = Counter()
        for (phase, op, _), n in log.calls.items():
            per_op[(phase, op)] += n
        counts.append(per_op)
    counts[1].subtract(counts[0])
    return {k: n / 2 for k, n in counts[1].items() if n}


def _count_families() -> list[dict]:
    names = ("llama", "phi3_mha", "phi3_fused", "olmo2_fullwidth_norm", "minicpm3", "gpt_oss")
    return [_per_block_collectives(name) for name in names]


def test_tp_collectives_per_block_at_tp2(world):
    """Megatron's minimum for a plain family, fused projections split per part (Phi3 with full MHA) and MLA split by
    heads around its whole latents (MiniCPM3), GPT-OSS on pp_tp's supplied plan (sinks by head, TP experts: every
    block is MoE); under GQA
    Phi3's qkv_proj and full-width q/k norms keep HF's own exact plan, which gathers the fused (or normed)
    projection output and splits it again before the row-parallel layer."""
    minimum = {("fwd", "all_reduce"): 2, ("bwd", "all_reduce"): 2}
    gathered_qkv = {**minimum, ("fwd", "all_gather_into_tensor"): 1, ("bwd", "all_gather_into_tensor"): 1}
    olmo2 = {**minimum, ("fwd", "all_gather_into_tensor"): 3, ("bwd", "all_gather_into_tensor"): 1}
    # MLA: + 4 once per step (one microbatch here), after the last backward: the Partial gradients of the latent
    # modules whole on every rank (q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm)
    mla = {("fwd", "all_reduce"): 2 + 4, ("bwd", "all_reduce"): 2}
    for llama, phi3_mha, phi3_gqa, olmo, minicpm3, gpt_oss in world(2).run(_count_families):
        assert (llama, phi3_mha, phi3_gqa, olmo, minicpm3) == (minimum, minimum, gathered_qkv, olmo2, mla)
        assert gpt_oss == minimum


# --- refusals, one line each, before any collective -----------------------------------------------


def _preflight(model: torch.nn.Module, **kw) -> None:
    preflight(model, ParallelConfig(**{"dp_shard": 1, **kw, "stages_per_rank": 1}), PreflightInputs("cpu", SEQ))


def test_a_parameter_in_the_sharded_middle_of_a_sub_block_makes_it_run_whole_under_tp():
    """Apertus' XIELU holds parameters between up_proj (column) and down_proj (row), which its plan leaves out: each
    TP rank would get a partial gradient (measured: 130 % off at pp2 x tp2), and their sum over TP ranks came out
    1.13x over the float64 verdict's bound. So its MLP runs whole on every TP rank (exact: the float64 verdict passes,
    tests/test_family_sweep.py), its attention still split, and the startup report names the MLP and its size."""
    from pp_tp.parallel.whole_on_tp import whole_in_blocks

    model = make("apertus", "meta")
    _preflight(model, pp=2, tp=2, embedding="vocab_parallel")
    layout = layout_for(model)
    assert layout.tp_plan["mlp"] == "replicate" and layout.tp_plan["self_attn.q_proj"] == "colwise"
    mlp = sum(p.numel() for b in model.model.layers for p in b.mlp.parameters())
    assert whole_in_blocks(model.model.layers.children(), layout) == {"mlp": (("ApertusMLP",), mlp)}


def test_an_attention_holding_its_own_ruleless_parameter_runs_whole_and_rules_naming_nothing_are_moot():
    """Doge's attention holds its per-head `A` itself (no child module, no rule): it runs whole on every TP rank,
    its MLP split; the rules its plan declares for the MoE MLP (`embedding_rowwise`, a style pp_tp lacks) name no
    module of its default dense build, so they refuse nothing (exact at pp2 x tp2 in bench/family_sweep.py)."""
    model = make("doge", "meta")
    _preflight(model, pp=2, tp=2)
    layout = layout_for(model)
    assert layout.tp_refusal is None
    assert layout.tp_plan["self_attn"] == "replicate" and layout.tp_plan["mlp.up_proj"] == "colwise"
    assert not any(rule.startswith("self_attn.") for rule in layout.tp_plan)


def test_tied_with_tp_needs_the_vocab_parallel_embedding():
    with pytest.raises(ConfigError, match='set parallel.embedding = "vocab_parallel"'):
        _preflight(make("llama_tied", "meta"), pp=2, tp=2, embedding="replicate")


@pytest.mark.parametrize(
    "name, tp, want",
    [("llama_tied", 2, "vocab_parallel"), ("llama_tied", 1, "replicate"), ("llama", 2, "replicate")],
)
def test_the_default_embedding_is_the_exact_choice(name, tp, want):
    """`parallel.embedding = "auto"` (the default) resolves to vocab-parallel exactly when the model ties and tp > 1."""
    pcfg = ParallelConfig(pp=2, tp=tp, dp_shard=1, stages_per_rank=1)
    assert pcfg.embedding == "auto"
    assert preflight(make(name, "meta"), pcfg, PreflightInputs("cpu", SEQ)).parallel.embedding == want


class _DoubledLogits(T.LlamaForCausalLM):
    """A family whose top-level forward does something the layout does not know (scales the logits)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_unknown_top_level_op_is_refused_by_the_self_check():
    config = T.LlamaConfig(**BASE)
    with torch.device("meta"):
        model = _DoubledLogits(config)
    with pytest.raises(ConfigError, match=r"model _DoubledLogits: its own forward differs .* pp_tp refuses it") as e:
        layout_for(model)
    assert "\n" not in str(e.value)


def test_family_without_a_pp_plan_gets_the_standard_layout():
    """No declared pp plan: embed_tokens -> layers -> norm gets a layout (then proven by the self-check); other
    structures are found from the forward or refused (tests/test_hf_discover.py)."""
    with torch.device("meta"):
        stablelm = T.AutoModelForCausalLM.from_config(T.StableLmConfig(**BASE))
    assert layout_for(stablelm).blocks == "model.layers"


def test_router_aux_loss_is_refused():
    mixtral = family(T.MixtralConfig, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
    model = mixtral.make("meta")
    with pytest.raises(ConfigError, match=r"output_router_logits = true .*use \[moe\] aux_loss_coef"):
        layout_for(model)


def test_hf_path_takes_the_shape_from_config_json_and_refuses_contradictions(tmp_path):
    from pp_tp.cli.job import check_job
    from pp_tp.config import load_config

    make("mistral_sliding").config.save_pretrained(tmp_path)
    job = tmp_path / "job.toml"
    job.write_text(
        f'[model]\nhf_path = "{tmp_path}"\n[parallel]\npp = 2\ntp = 2\nembedding = "vocab_parallel"\n'
        "microbatches = 2\n[training]\nbatch_size = 4\nseq_len = 16\n"
    )
    cfg, checked = check_job(load_config(str(job), world_size=4), 4, data=False)
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.vocab_size) == (32, 4, VOCAB)
    assert checked.layout.name == "hf" and checked.layout.blocks == "model.layers"
    with pytest.raises(ConfigError, match=r"model.n_layers = 6 contradicts .*config.json \(4\)") as e:
        check_job(load_config(str(job), ["model.n_layers=6"], world_size=4), 4, data=False)
    assert "\n" not in str(e.value)
