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
    overwrites the persistent ones afterwards)."""
    for module in stage.modules():
        if next(module.buffers(recurse=False), None) is None:
            continue
        params = dict(module.named_parameters(recurse=False))
        for name, p in params.items():
            setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad))
        try:
            model._init_weights(module)
        finally:
            for name, p in params.items():
                setattr(module, name, p)
