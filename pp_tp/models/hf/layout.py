"""Hugging Face decoder LMs: the model layout and tensor-parallel plan pp_tp uses for them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pp_tp.stages.layouts import ModelDims, ModelLayout


def _is_hf_llama_like(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return (
        hasattr(model, "lm_head")
        and inner is not None
        and all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))
    )


def _hf_dims(model: nn.Module) -> ModelDims:
    c = model.config
    return ModelDims(
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        c.intermediate_size,
        c.vocab_size,
        c.max_position_embeddings,
        bool(getattr(c, "tie_word_embeddings", False)),
    )


def _hf_block_inputs(stage: nn.Module, h: torch.Tensor) -> tuple[Any, ...]:
    position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    return (position_ids, stage.get_submodule("model.rotary_emb")(h, position_ids))


def _hf_call_block(block: nn.Module, h: torch.Tensor, extras: tuple[Any, ...]) -> torch.Tensor:
    position_ids, position_embeddings = extras
    # attention_mask=None: SDPA attention is causal.
    out = block(h, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings)
    return out[0] if isinstance(out, tuple) else out


def _hf_init_buffers(stage: nn.Module, model: nn.Module) -> None:
    rot = stage.get_submodule("model.rotary_emb")
    fresh = type(rot)(config=model.config)
    for name, buf in fresh.named_buffers():
        setattr(rot, name, buf.to(rot.inv_freq.device))


HF_LLAMA = ModelLayout(
    name="hf_llama",
    matches=_is_hf_llama_like,
    dims=_hf_dims,
    embed="model.embed_tokens",
    blocks="model.layers",
    norm="model.norm",
    head="lm_head",
    shared=("model.rotary_emb",),
    block_inputs=_hf_block_inputs,
    call_block=_hf_call_block,
    init_buffers=_hf_init_buffers,
    tp_plan={
        "self_attn": "replicate_input",
        "mlp": "replicate_input",
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
    },
    qk_norms=("self_attn.q_norm", "self_attn.k_norm"),
    attention="self_attn",
)
