"""Layers the model's own forward skips on token ids alone (Mllama's cross-attention layers on text without images).

Every layer stays on its stage, so every parameter lives on some rank and is seeded and loaded as today; a stage
passes the hidden state through a skipped layer unchanged, as the model's forward does, so its parameters get no
gradient (None), as in the plain model. Skipping is read off the traced forward's structure alone (the layers' indices
in the order it runs them), the same on every rank; a forward that loops or reorders layers is refused by the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pp_tp.models.hf.discover import embedding_parent
from pp_tp.models.hf.handed import Handed

CallBlock = Callable[..., torch.Tensor]


def skipped_layers(model: nn.Module, blocks: str, found: Handed | None) -> frozenset[int] | None:
    """Indices of `model`'s layers (under `blocks`, relative to the module holding the embedding) of a class the
    traced forward of the small copy (`found`) never runs, where it runs the others once each, in list order, and
    runs or skips every layer of a class alike (the small copy holds each kind of layer, so the class carries the
    decision to the full model); empty where it runs all (or was not traced: the self-check judges it); None where it
    loops or reorders them (Dory: [0, 1, 0, 1]), runs none, or skips by position rather than class."""
    if found is None or found.run_once_in_order():
        return frozenset()
    runs = list(found.runs)
    if not runs or runs != sorted(set(runs)):
        return None
    with torch.device("meta"):
        small = type(model)(found.config)
    kinds = [type(layer) for layer in small.get_submodule(embedding_parent(small)).get_submodule(blocks)]
    ran = {kinds[k] for k in runs}
    if any(kind in ran for k, kind in enumerate(kinds) if k not in runs):
        return None
    layers = model.get_submodule(embedding_parent(model)).get_submodule(blocks)
    return frozenset(k for k, layer in enumerate(layers) if type(layer) not in ran)


def skipping(call_block: CallBlock, skipped: frozenset[int]) -> CallBlock:
    """`call_block` that hands the hidden state through the layers at `skipped` (global indices) unchanged (identity,
    as the model's forward does by not calling them); `call_block` itself where none is skipped."""
    if not skipped:
        return call_block

    def call(block: nn.Module, h: torch.Tensor, extras: tuple[Any, ...], index: int, **handed: Any) -> torch.Tensor:
        return h if index in skipped else call_block(block, h, extras, index, **handed)

    return call
