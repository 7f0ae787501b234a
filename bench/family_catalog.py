"""Which Hugging Face families bench/family_sweep.py runs, their default configs (repaired where transformers' own
model cannot run them) and the parallel layout each runs in."""

from __future__ import annotations

import inspect
from typing import Any

import transformers
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
    MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES,
)

import pp_tp

_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")

_MOE_SWITCHES = ("enable_moe_block", "is_moe")

# Config values a family's default config leaves broken in transformers' own model (the values its published
# checkpoints use), applied before small_config; each row's note says "config repaired: key=value". Only what the
# plain model needs to build and run, never anything pp_tp would need.
_QSA = dict(indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=256, indexer_budget=8, indexer_compress_ratio=4)

CONFIG_REPAIRS: dict[str, dict[str, Any]] = {
    # rope_parameters left {} while every layer is "full_attention": "KeyError: 'full_attention'" (the rotary reads
    # rope_parameters[layer type]); RoPE at the default base, not checked against CohereLabs/North-Micro-Vision.
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # attn_config without rope_theta: "'DbrxAttentionConfig' object has no attribute 'rope_theta'"; then clip_qkv
    # None: "torch.clamp: At least one of 'min' or 'max' must not be None". dbrx-instruct's values.
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8}},
    # layer_types left None: "'NoneType' object is not subscriptable" (modeling_lfm2_moe.py:474). LFM2's hybrid
    # pattern: short convolutions, a full-attention layer every 4th.
    "lfm2_moe": {"layer_types": ["full_attention" if i % 4 == 2 else "conv" for i in range(32)]},
    # layer_types default to "indexed_attention" with every indexer_* field None: "unsupported operand type(s) for
    # //: 'NoneType' and 'NoneType'" (modeling_qwen4_exp.py:699). The validator's constraints (one key head, head dim
    # >= the rotary dim 256, budget a multiple of the ratio); a budget of 8 tokens, so 16-token rows really select.
    "qwen4_exp": {"text_config": _QSA},
    "qwen4_exp_text": _QSA,
}


def out_of_scope(model_type: str) -> str | None:
    """Why a model type is not a decoder-only LM for the sweep, or None when it is one.

    Encoder-decoder and encoder-only families (their causal LM is a seq2seq model's decoder or a masked LM's encoder
    run causally), and multimodal ones whose causal-LM class holds an image or audio encoder besides the decoder (the
    class is built from the whole composite config, not its text config); their text decoders are rows of their own
    where transformers registers one (gemma3 -> gemma3_text)."""
    mappings = (
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES,  # MusicGen: the decoder of a text-conditioned encoder-decoder
    )
    if any(model_type in m for m in mappings):
        return "encoder-decoder or encoder-only"
    if "shared_kv_states" in inspect.signature(_causal_lm_class(model_type).forward).parameters:
        return "draft model: its forward needs another model's embeddings and KV states (shared_kv_states)"
    multimodal = (MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    if any(model_type in m for m in multimodal) and not text_config_class(model_type):
        return "multimodal: an image or audio encoder beside the decoder"
    return None


def _causal_lm_class(model_type: str) -> type:
    """The causal-LM class transformers maps this type to."""
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def text_config_class(model_type: str) -> bool:
    """Whether transformers builds this type's causal LM from the text sub-config alone (Llama 4, Qwen3.5: the
    decoder without the vision tower), as `AutoModelForCausalLM.from_config` decides."""
    config_class = CONFIG_MAPPING[model_type]
    text = getattr(config_class, "sub_configs", {}).get("text_config")
    model_class = AutoModelForCausalLM._model_mapping.get(config_class, None)
    return text is not None and getattr(model_class, "config_class", None) is text


def families() -> list[str]:
    """Model types of every decoder-only causal-LM family, with a declared pipeline plan or not."""
    return [t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if out_of_scope(t) is None]


def class_name(model_type: str) -> str:
    """The mapping's class name, for a family whose model never got built (the built class, when there is one,
    can differ: some model types map onto another family's class)."""
    return str(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ""))


def is_moe(config: Any) -> bool:
    """More than one expert, and no config switch turning its MoE blocks off (Gemma 4's `enable_moe_block`, Doge's
    `is_moe`: their default builds are dense): these run with the MoE layout (`--moe-layout`)."""
    if any(getattr(config, k, None) is False for k in _MOE_SWITCHES):
        return False
    ffn = getattr(config, "ffn_config", None)  # DBRX: the expert count in its FFN sub-config
    counts = [getattr(config, k, None) for k in _EXPERT_COUNTS] + [getattr(ffn, "moe_num_experts", None)]
    return max(c or 0 for c in counts) > 1


# MoE layouts on 4 ranks: experts whole on every rank (pp2 x dp_shard2), split over 2 EP ranks (pp2 x dp_shard2
# x ep2), or TP of experts (pp2 x tp2).
MOE_LAYOUTS = {"dp_shard": dict(pp=2, dp_shard=2, tp=1), "ep": dict(pp=2, dp_shard=2, ep=2), "tp": dict(pp=2, tp=2)}


def parallel_config(config: Any, moe_layout: str = "ep") -> pp_tp.ParallelConfig:
    """pp2 x tp2 for dense families (those declaring no TP plan too: pp_tp infers and proves their pairs, or runs a
    region it cannot split whole on every TP rank); MoE families in `moe_layout` (MOE_LAYOUTS)."""
    shape = MOE_LAYOUTS[moe_layout] if is_moe(config) else dict(pp=2, dp_shard=1, tp=2)
    return pp_tp.ParallelConfig(**{"dp_shard": 1, **shape}, schedule="1F1B", microbatches=2, mixed_precision="fp32")


def layout_name(pcfg: pp_tp.ParallelConfig) -> str:
    """How a row names its layout."""
    parts = [f"pp{pcfg.pp}"] + [f"{k}{getattr(pcfg, k)}" for k in ("dp_shard", "ep", "tp") if getattr(pcfg, k) > 1]
    return " ".join(parts)


def default_config(model_type: str) -> Any:
    """The family's default config, with its `CONFIG_REPAIRS` entry."""
    return CONFIG_MAPPING[model_type](**CONFIG_REPAIRS.get(model_type, {}))


def repair_note(model_type: str) -> str:
    """ "config repaired: key=value, ..." for a type with a `CONFIG_REPAIRS` entry (nested dicts as dotted keys,
    long values cut), else ""."""

    def flat(prefix: str, value: Any) -> list[str]:
        if isinstance(value, dict):
            return [item for k, v in value.items() for item in flat(f"{prefix}{k}.", v)]
        text = repr(value)
        return [f"{prefix[:-1]}={text if len(text) <= 60 else text[:56] + ' ...'}"]

    repairs = CONFIG_REPAIRS.get(model_type)
    return f"config repaired: {', '.join(flat('', repairs))}" if repairs else ""
