"""Model layouts: where a model keeps its embedding, blocks, final norm and head, and how to call a block.

The stage builder knows nothing about a model beyond its layout, so a stage never needs the model's own
forward to tolerate missing modules. Register a layout for your own model with `register_layout` (or a
`pp_tp.model_layouts` entry point) without touching pp_tp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.models.llama import Transformer, param_init_std


@dataclass(frozen=True)
class ModelDims:
    """The numbers plans, cost models and TP checks need, whatever the model's own config calls them."""

    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    tied: bool


@dataclass(frozen=True)
class ModelLayout:
    """Describes one model family to the stage builder.

    ``shared``: names (modules or non-persistent buffers) every stage keeps, e.g. rotary tables.
    ``block_inputs(stage, h)``: the extra positional args each block needs after the hidden state.
    ``call_block(block, h, extras)``: runs one block, returning the new hidden state.
    ``init_buffers(stage, model)``: recomputes non-persistent buffers after meta -> device materialization.
    ``tp_plan``: block-relative FQN -> style name, used by the tensor-parallel pass. "replicate_input" on the
    attention and MLP modules makes backward all-reduce once per sub-block, not once per column-parallel Linear.
    ``attention``: block-relative name of the attention module (selective activation checkpointing).
    """

    name: str
    matches: Callable[[nn.Module], bool]
    dims: Callable[[nn.Module], ModelDims]
    embed: str
    blocks: str
    norm: str
    head: str
    shared: tuple[str, ...]
    block_inputs: Callable[[nn.Module, torch.Tensor], tuple[Any, ...]]
    call_block: Callable[[nn.Module, torch.Tensor, tuple[Any, ...]], torch.Tensor]
    init_buffers: Callable[[nn.Module, nn.Module], None]
    tp_plan: dict[str, str] = field(default_factory=dict)
    qk_norms: tuple[str, ...] = ()
    attention: str = "attention"
    init_std: Callable[[str, int], float | None] = param_init_std

    def block_keys(self, model: nn.Module) -> list[str]:
        """The blocks' names inside the blocks container, in execution order."""
        return [name for name, _ in model.get_submodule(self.blocks).named_children()]


_LAYOUTS: list[ModelLayout] = []


def register_layout(layout: ModelLayout) -> None:
    """Adds a layout; later registrations win, so a user's layout can override a built-in one."""
    _LAYOUTS.insert(0, layout)


def layout_for(model: nn.Module) -> ModelLayout:
    from pp_tp.plugins import load_plugins

    load_plugins()
    for layout in _LAYOUTS:
        if layout.matches(model):
            return layout
    raise ConfigError(f"model {type(model).__name__}: no model layout matches it; register one with "
                      "pp_tp.stages.layouts.register_layout (see ModelLayout)")


# --- the reference Transformer ------------------------------------------------------------------

def _ref_dims(model: Transformer) -> ModelDims:
    a = model.args
    return ModelDims(a.n_layers, a.dim, a.n_heads, a.kv_heads, a.ffn_dim, a.vocab_size, a.max_seq_len,
                     a.tie_embeddings)


def _ref_init_buffers(stage: nn.Module, model: Transformer) -> None:
    from pp_tp.models.llama import rope_cache

    a = model.args
    stage.rope = rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, stage.rope.device)


_BLOCK_TP_PLAN = {
    "attention": "replicate_input", "feed_forward": "replicate_input",
    "attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise", "attention.wo": "rowwise",
    "feed_forward.w1": "colwise", "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise",
}

REFERENCE = ModelLayout(
    name="reference",
    matches=lambda m: isinstance(m, Transformer),
    dims=_ref_dims,
    embed="tok_embeddings",
    blocks="layers",
    norm="norm",
    head="output",
    shared=("rope",),
    block_inputs=lambda stage, h: (stage.rope,),
    call_block=lambda block, h, extras: block(h, *extras),
    init_buffers=_ref_init_buffers,
    tp_plan=_BLOCK_TP_PLAN,
    qk_norms=("attention.q_norm", "attention.k_norm"),
)


# --- Hugging Face Llama family (LlamaForCausalLM, Qwen2/3, Mistral, ...) ---------------------------

def _is_hf_llama_like(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return (hasattr(model, "lm_head") and inner is not None
            and all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")))


def _hf_dims(model: nn.Module) -> ModelDims:
    c = model.config
    return ModelDims(c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                     getattr(c, "num_key_value_heads", None) or c.num_attention_heads, c.intermediate_size,
                     c.vocab_size, c.max_position_embeddings, bool(getattr(c, "tie_word_embeddings", False)))


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
        "self_attn": "replicate_input", "mlp": "replicate_input",
        "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
    },
    qk_norms=("self_attn.q_norm", "self_attn.k_norm"),
    attention="self_attn",
)

register_layout(HF_LLAMA)
register_layout(REFERENCE)
