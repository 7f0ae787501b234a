"""Model layouts: where a model keeps its embedding, blocks, final norm and head, and how to call a block.

The stage builder knows nothing about a model beyond its layout, so a stage never needs the model's own
forward to tolerate missing modules. Register a layout for your own model with `register_layout` (or a
`pp_tp.model_layouts` entry point) without touching pp_tp.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pp_tp.base.seeded_init import InitStd, default_init_std
from pp_tp.errors import ConfigError
from pp_tp.layout.experts import ExpertsSpec


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
    head_dim: int = 0  # 0: dim // n_heads; else the model's own (then dim need not be n_heads * head_dim)
    streams: int = 1  # residual streams per token between blocks (hyper-connections' hc_mult): [B, S, streams, dim]


@dataclass(frozen=True)
class ModelLayout:
    """Describes one model family to the stage builder.

    ``shared``: names (modules or non-persistent buffers) every stage keeps, e.g. rotary tables.
    ``block_inputs(stage, h)``: the extra args each block needs after the hidden state.
    ``document_block_inputs(stage, h, position_ids)``: the block args for per-token position ids that restart at every
    document (`data.document_mask`): positions from them and attention kept inside each document; None = the layout
    cannot mask documents (refused in one line).
    ``static_block_inputs``: True when block_inputs depends on h only through its shape, dtype and device (masks,
    rotary tables), so a step computes them once per microbatch shape; False (the default) calls it per microbatch.
    ``call_block(block, h, extras)``: runs one block, returning the new hidden state.
    ``init_buffers(stage, model)``: recomputes non-persistent buffers after meta -> device materialization.
    ``tp_plan``: block-relative FQN -> style name, used by the tensor-parallel pass. "replicate_input" on the
    attention and MLP modules makes backward all-reduce once per sub-block, not once per column-parallel Linear.
    ``attention``: block-relative name of the attention module (selective activation checkpointing).
    ``after_embed(h)`` / ``after_head(logits)``: what the model's own forward does outside its modules right
    after the embedding and after the head (embedding multipliers, logit scaling or softcapping).
    ``after_embed_modules`` / ``before_norm_modules``: parameterless modules (dropout, identity) the model runs
    on the hidden state right after the embedding / right before the final norm; the first / last stage holds
    and runs them, with the modules around them.
    ``tp_refusal``: why this model cannot run with parallel.tp > 1 (raised in one line), or None.
    ``experts_spec``: the family's mixture-of-experts experts, one record (`ExpertsSpec`: modules, weights, calling
    convention, counts, routers, expert biases), or None for a dense model; ``experts`` and ``expert_bias`` read it.
    ``specialize(model)``: for a layout that matches a whole family (e.g. every Hugging Face decoder LM), the
    layout of this one model; it may refuse the model in one line.
    ``pre`` / ``post``: for a model that is not a language model (a ViT, a weather model), the modules the first
    stage runs in order before the blocks (patch embedding, ...) and the last one after them (norm, head, ...), any
    names; they replace ``embed`` and ``norm`` -> ``head`` (leave those "", or build it with `blocks_layout`). Such
    a model takes any input tensor, hands on whatever its stages output, and trains with the caller's loss.
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
    init_std: InitStd = default_init_std
    after_embed: Callable[[torch.Tensor], torch.Tensor] | None = None
    after_head: Callable[[torch.Tensor], torch.Tensor] | None = None
    specialize: Callable[[nn.Module], ModelLayout] | None = None
    tp_refusal: str | None = None
    static_block_inputs: bool = False
    experts_spec: ExpertsSpec | None = None
    pre: tuple[str, ...] = ()
    post: tuple[str, ...] = ()

    @property
    def is_lm(self) -> bool:
        """A language model: token ids in, an embedding first, vocabulary logits out of a head last."""
        return not (self.pre or self.post)

    @property
    def first_fqns(self) -> tuple[str, ...]:
        """The modules the first stage runs, in order, before its blocks."""
        return self.pre if not self.is_lm else (self.embed,)

    @property
    def last_fqns(self) -> tuple[str, ...]:
        """The modules the last stage runs, in order, after its blocks."""
        if not self.is_lm:
            return self.post
        return tuple(f for f in (self.norm, *self.before_head, self.head) if f)  # norm "": none

    @property
    def experts(self) -> tuple[str, ...]:
        """Block-relative names of the experts modules (empty: a dense model)."""
        return self.experts_spec.modules if self.experts_spec is not None else ()

    @property
    def expert_bias(self) -> tuple[str, ...]:
        """Block-relative names of the expert-bias buffers."""
        return self.experts_spec.bias if self.experts_spec is not None else ()

    after_embed_modules: tuple[str, ...] = ()
    before_norm_modules: tuple[str, ...] = ()
    # Modules with weights a language model runs between its final norm and its head (ModernBERT-decoder's
    # prediction head); the last stage holds and runs them, in order.
    before_head: tuple[str, ...] = ()
    document_block_inputs: Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[Any, ...]] | None = None
    # (stage, input_ids, position_ids or None) -> the first block's input, for a language model whose forward adds
    # more than the embedding (learned positions: GPT-2, OPT); it replaces embed -> after_embed ->
    # after_embed_modules in the first stage, which holds the modules it reads (named in after_embed_modules).
    embed_call: Callable[[nn.Module, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
    # The blocks read the batch's token ids (DeepSeek-V4's hash routers): `Pipeline.step` hands every stage its
    # microbatch's ids (a schedule keyword, as position ids) and the stage appends them to `call_block`'s extras.
    block_ids: bool = False
    # What the last stage runs on the hidden state right before its norm, outside any module (dropping what the
    # stream carries beside the hidden state: Gemma 4's per-layer inputs); None: nothing.
    before_norm: Callable[[torch.Tensor], torch.Tensor] | None = None

    def block_keys(self, model: nn.Module) -> list[str]:
        """The blocks' names inside the blocks container, in execution order."""
        return [name for name, _ in model.get_submodule(self.blocks).named_children()]


def blocks_layout(
    name: str,
    matches: Callable[[nn.Module], bool],
    dims: Callable[[nn.Module], ModelDims],
    pre: tuple[str, ...],
    blocks: str,
    post: tuple[str, ...],
    **extra: Any,
) -> ModelLayout:
    """The layout of a model that is not a language model: `pre` modules, a blocks container, `post` modules, each
    block called as `block(h)` unless `extra` says otherwise (any ModelLayout field)."""
    fields = dict(
        shared=(),
        block_inputs=lambda stage, h: (),
        call_block=lambda block, h, extras: block(h, *extras),
        init_buffers=lambda stage, model: None,
    )
    fields.update(extra)
    return ModelLayout(name=name, matches=matches, dims=dims, embed="", blocks=blocks, norm="", head="",
                       pre=pre, post=post, **fields)  # fmt: skip


_LAYOUTS: list[ModelLayout] = []


def register_layout(layout: ModelLayout) -> None:
    """Adds a layout; later registrations win, so a user's layout can override a built-in one."""
    _LAYOUTS.insert(0, layout)


def layout_for(model: nn.Module) -> ModelLayout:
    """The most recently registered layout that matches `model`; refused in one line when none does."""
    for layout in _LAYOUTS:
        if layout.matches(model):
            return layout.specialize(model) if layout.specialize is not None else layout
    raise ConfigError(
        f"model {type(model).__name__}: no model layout matches it; register one with "
        "pp_tp.extend.register_layout (see ModelLayout)"
    )


def check_document_mask(layout: ModelLayout) -> None:
    """Packed documents need a layout that masks them (`document_block_inputs`); refused in one line otherwise."""
    if layout.document_block_inputs is None:
        raise ConfigError(
            f"data.document_mask = true: the {layout.name!r} model layout cannot keep attention inside documents "
            "(no document_block_inputs); set data.document_mask = false or give the layout document_block_inputs"
        )
