"""Buffers of a Hugging Face stage after meta materialization: non-persistent ones (rotary tables, embedding
scales), and persistent ones (router biases) by the model's own init rule, for builds without a source.

transformers fills them in `_init_weights` (its own rule per module type); it would also re-draw the module's
parameters, so those are swapped for meta placeholders while it runs (values come later, by FQN).
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_buffers(stage: nn.Module, model: nn.Module) -> None:
    """Recomputes every buffer of `stage` with the model's own `_init_weights` rules (a source, when there is one,
    overwrites the persistent ones afterwards). A base model's rule may fill its layers' buffers (Falcon-H1's
    `mup_vector`): it runs on `model`'s own base models too, whose layers the stage shares."""
    from transformers import PreTrainedModel  # here, so importing pp_tp does not import transformers

    for module in stage.modules():
        if next(module.buffers(recurse=False), None) is not None:
            _without_parameters(model, module, recurse=False)
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module is not model:
            _without_parameters(model, module, recurse=True)


def _without_parameters(model: nn.Module, module: nn.Module, recurse: bool) -> None:
    """`model._init_weights(module)` with `module`'s parameters (all below it, with `recurse`) swapped for meta
    placeholders, so only buffers take its values."""
    owners = list(module.modules()) if recurse else [module]
    saved = [(m, dict(m.named_parameters(recurse=False))) for m in owners]
    for m, params in saved:
        for name, p in params.items():
            setattr(m, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad))
    try:
        model._init_weights(module)
    finally:
        for m, params in saved:
            for name, p in params.items():
                setattr(m, name, p)
