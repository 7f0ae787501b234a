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


EdgeCall = Callable[[nn.Module, torch.Tensor, Any], torch.Tensor]  # (stage, h, position_ids or None) -> h


@dataclass(frozen=True)
class Edge:
    """What the first stage runs before its blocks, or the last stage after them.

    ``modules``: the model's modules (FQNs, model order) the stage holds for it; for a language model the first
    edge's first module is the token embedding and the last edge's last module the vocabulary head.
    ``call(stage, h, position_ids)``: the stage's only code path there (the batch's input in, the first block's input
    out; the last block's output in, the model's output out). `in_order` builds the usual one.
    """

    modules: tuple[str, ...]
    call: EdgeCall


@dataclass(frozen=True)
class _InOrder:
    """Runs each step on h in turn: a module FQN is called, anything else is a function of h (a multiplier)."""

    steps: tuple[Any, ...]

    def __call__(self, stage: nn.Module, h: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        for step in self.steps:
            h = stage.get_submodule(step)(h) if isinstance(step, str) else step(h)
        return h


def in_order(*steps: str | Callable[[torch.Tensor], torch.Tensor] | None) -> Edge:
    """The edge that runs `steps` in order on h: module FQNs (held by the stage) and functions of h (what the
    model's forward does outside its modules: embedding multipliers, logit softcapping); "" and None are skipped."""
    kept = tuple(s for s in steps if s)
    return Edge(tuple(s for s in kept if isinstance(s, str)), _InOrder(kept))


@dataclass(frozen=True)
class ModelLayout:
    """Describes one model family to the stage builder: a core (blocks and how to call them) and two edges.

    ``first`` / ``last``: what the first stage runs before the blocks and the last stage after them (`Edge`: the
    modules it holds and the one callable that runs them).
    ``is_lm``: a language model (token ids in, vocabulary logits out: its first edge opens with the embedding, its
    last closes with the head); False for a ViT or a weather model, which takes any input tensor, hands on whatever
    its stages output, and trains with the caller's loss (`blocks_layout`).
    ``shared``: names (modules or non-persistent buffers) every stage keeps, e.g. rotary tables.
    ``block_inputs(stage, h)``: the extra args each block needs after the hidden state.
    ``document_block_inputs(stage, h, position_ids)``: the block args for per-token position ids that restart at every
    document (`data.document_mask`): positions from them and attention kept inside each document; None = the layout
    cannot mask documents (refused in one line).
    ``static_block_inputs``: True when block_inputs depends on h only through its shape, dtype and device (masks,
    rotary tables), so a step computes them once per microbatch shape; False (the default) calls it per microbatch.
    ``call_block(block, h, extras, index)``: runs one block, returning the new hidden state; every stage hands it the
    block's global index, its position in ``blocks`` (`block_keys`), which a layout may ignore or use (a Hugging Face
    layer taking its own, Zamba2's `layer_idx`; Gemma 4's slice of the per-layer inputs; Mllama's skipped layers).
    ``block_ids``: the blocks read the batch's token ids (DeepSeek-V4's hash routers): `Pipeline.step` hands every
    stage its microbatch's ids (a schedule keyword, as position ids) and the stage appends them to the extras.
    ``init_buffers(stage, model)``: recomputes non-persistent buffers after meta -> device materialization.
    ``tp_plan``: block-relative FQN -> style name, used by the tensor-parallel pass. "replicate_input" on the
    attention and MLP modules makes backward all-reduce once per sub-block, not once per column-parallel Linear.
    ``attention``: block-relative name of the attention module (selective activation checkpointing).
    ``tp_refusal``: why this model cannot run with parallel.tp > 1 (raised in one line), or None.
    ``experts_spec``: the family's mixture-of-experts experts, one record (`ExpertsSpec`: modules, weights, calling
    convention, counts, routers, expert biases), or None for a dense model; ``experts`` and ``expert_bias`` read it.
    ``specialize(model)``: for a layout that matches a whole family (e.g. every Hugging Face decoder LM), the
    layout of this one model; it may refuse the model in one line.
    """

    name: str
    matches: Callable[[nn.Module], bool]
    dims: Callable[[nn.Module], ModelDims]
    first: Edge
    blocks: str
    last: Edge
    shared: tuple[str, ...]
    block_inputs: Callable[[nn.Module, torch.Tensor], tuple[Any, ...]]
    call_block: Callable[[nn.Module, torch.Tensor, tuple[Any, ...], int], torch.Tensor]
    init_buffers: Callable[[nn.Module, nn.Module], None]
    tp_plan: dict[str, str] = field(default_factory=dict)
    qk_norms: tuple[str, ...] = ()
    attention: str = "attention"
    init_std: InitStd = default_init_std
    specialize: Callable[[nn.Module], ModelLayout] | None = None
    tp_refusal: str | None = None
    static_block_inputs: bool = False
    experts_spec: ExpertsSpec | None = None
    document_block_inputs: Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[Any, ...]] | None = None
    block_ids: bool = False
    is_lm: bool = True

    @property
    def embed(self) -> str:
        """A language model's token embedding (the first edge's first module); "" for other models."""
        return self.first.modules[0] if self.is_lm and self.first.modules else ""

    @property
    def head(self) -> str:
        """A language model's vocabulary head (the last edge's last module); "" for other models."""
        return self.last.modules[-1] if self.is_lm and self.last.modules else ""

    @property
    def experts(self) -> tuple[str, ...]:
        """Block-relative names of the experts modules (empty: a dense model)."""
        return self.experts_spec.modules if self.experts_spec is not None else ()

    @property
    def expert_bias(self) -> tuple[str, ...]:
        """Block-relative names of the expert-bias buffers."""
        return self.experts_spec.bias if self.experts_spec is not None else ()

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
        call_block=lambda block, h, extras, index: block(h, *extras),
        init_buffers=lambda stage, model: None,
    )
    fields.update(extra)
    return ModelLayout(name=name, matches=matches, dims=dims, first=in_order(*pre), blocks=blocks,
                       last=in_order(*post), is_lm=False, **fields)  # fmt: skip


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
