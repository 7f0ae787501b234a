"""The stage module: one pipeline stage's share of a model, under the full model's parameter names.

It holds the original submodules at their original paths (``layers.7`` stays ``layers.7``), so state
dicts, checkpoints and optimizers see the full model's FQNs. Its own forward runs embed (first stage)
-> its blocks -> norm and head (last stage) through the model layout, so the model's forward is never
asked to skip missing modules. Between stages only one plain tensor flows (``[microbatch, seq, hidden]`` for a
language model, any shape for others).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pp_tp.base._torch import (
    AsyncCollectiveTensor,
    child_modules,
    is_persistent_buffer,
    is_traceable_wrapper_subclass,
    tree_flatten,
    wait_tensor,
)
from pp_tp.layout import ModelLayout
from pp_tp.split.plan import StageSpec


def _attach(root: nn.Module, model: nn.Module, fqn: str) -> None:
    """Puts `model`'s module or buffer at `fqn` under `root` at the same path, creating containers."""
    *parents, leaf = fqn.split(".")
    node, src = root, model
    for part in parents:
        src = src.get_submodule(part)
        if part not in child_modules(node):
            container = (
                nn.ModuleDict() if isinstance(src, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) else nn.Module()
            )
            node.add_module(part, container)
        node = child_modules(node)[part]
    if leaf in child_modules(src):
        node.add_module(leaf, child_modules(src)[leaf])
    else:
        node.register_buffer(leaf, src.get_buffer(leaf), persistent=is_persistent_buffer(src, leaf))


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter name -> its canonical one: a tied weight has several names, the first the model lists wins.

    Take it before any stage of a rank is materialized: that replaces the shared modules' tensors and unties them.
    """
    first: dict[int, str] = {}
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names[name] = first.setdefault(id(p), name)
    return names


# Attributes every StageModule sets on itself: a model module of the same top-level name cannot be attached.
_OWN_ATTRS = ("layout", "spec", "checkpoint_keys")


def reserved_name(name: str) -> bool:
    """A top-level module name a stage cannot hold under the model's own name (it is a StageModule attribute)."""
    return name in _OWN_ATTRS or hasattr(StageModule, name)


class StageModule(nn.Module):
    """One pipeline stage. `named_parameters()` yields exactly the full model's names for what it owns."""

    def __init__(self, model: nn.Module, layout: ModelLayout, spec: StageSpec, aliases: dict[str, str] | None = None):
        super().__init__()
        self.layout = layout
        self.spec = spec
        for fqn in spec.fqns + list(layout.shared):
            _attach(self, model, fqn)
        aliases = canonical_names(model) if aliases is None else aliases
        # Each local parameter name -> the model's canonical key for its value (seeded init, checkpoints).
        self.checkpoint_keys: dict[str, str] = {
            name: aliases.get(name, name) for name, _ in self.named_parameters(remove_duplicate=False)
        }
        self._block_inputs_cache: dict[tuple, tuple[Any, ...]] | None = None  # on only inside reuse_block_inputs()
        keys = layout.block_keys(model) if spec.blocks else []
        self._indices = [keys.index(key) for key in spec.blocks]  # each block's global index, for `call_block`

    @property
    def is_first(self) -> bool:
        return self.spec.embed

    @property
    def is_last(self) -> bool:
        return self.spec.head

    def block_modules(self) -> list[nn.Module]:
        if not self.spec.blocks:
            return []
        container = self.get_submodule(self.layout.blocks)
        return [container[k] for k in self.spec.blocks]

    @contextlib.contextmanager
    def reuse_block_inputs(self) -> Iterator[None]:
        """Inside: for a layout with `static_block_inputs` (masks, position ids, rotary tables from h's shape only),
        the blocks' extra inputs are computed once per microbatch shape instead of once per microbatch; extras
        that require grad are never reused. Other layouts (per-microbatch positions) are called every time."""
        self._block_inputs_cache = {}
        try:
            yield
        finally:
            self._block_inputs_cache = None

    def _block_inputs(self, h: torch.Tensor) -> tuple[Any, ...]:
        cache = self._block_inputs_cache
        if cache is None or not self.layout.static_block_inputs:
            return self.layout.block_inputs(self, h)
        key = (tuple(h.shape), h.dtype, h.device)
        if key not in cache:
            extras = self.layout.block_inputs(self, h)
            if any(t.requires_grad for t in tree_flatten(extras)[0] if isinstance(t, torch.Tensor)):
                return extras
            cache[key] = extras
        return cache[key]

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor | None = None, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`position_ids` [microbatch, seq] (every stage gets them from the schedule): positions restarting at each
        packed document, with attention kept inside it; None: one sequence per row. `input_ids`: the microbatch's
        token ids, which every stage gets from the schedule where the blocks read them (`layout.block_ids`)."""
        lay = self.layout
        ids = x if input_ids is None and self.is_first else input_ids
        h = x
        if self.is_first:
            h = lay.first.call(self, x, position_ids)
        if self.spec.blocks:
            extras = self._block_inputs(h) if position_ids is None else lay.document_block_inputs(self, h, position_ids)
            if lay.block_ids:
                if ids is None:
                    raise TypeError(f"stage {self.spec.index}: its blocks read the token ids; pass input_ids")
                extras = (*extras, ids)
            for index, block in zip(self._indices, self.block_modules()):
                h = lay.call_block(block, h, extras, index)
        if self.is_last:
            h = lay.last.call(self, h, position_ids)
        if isinstance(h, AsyncCollectiveTensor):  # a TP all-reduce/all-gather still in flight: finish it here
            h = wait_tensor(h)
        h = h.contiguous()  # p2p sends need it; a permuted field (channel norms, [B, C, H, W]) may not be
        if is_traceable_wrapper_subclass(h):  # DTensor & co.; a FakeTensor (planner dry run) is plain
            raise TypeError(
                f"stage {self.spec.index} outputs a {type(h).__name__}; stage boundaries carry plain "
                "torch.Tensor (a TP style at the stage's edge needs use_local_output=True)"
            )
        return h
