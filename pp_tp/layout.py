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

from pp_tp.errors import ConfigError
from pp_tp.seeded_init import InitStd, default_init_std


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
    ``tp_refusal``: why this model cannot run with parallel.tp > 1 (raised in one line), or None.
    ``specialize(model)``: for a layout that matches a whole family (e.g. every Hugging Face decoder LM), the
    layout of this one model; it may refuse the model in one line.
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
    document_block_inputs: Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[Any, ...]] | None = None

    def block_keys(self, model: nn.Module) -> list[str]:
        """The blocks' names inside the blocks container, in execution order."""
        return [name for name, _ in model.get_submodule(self.blocks).named_children()]


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
