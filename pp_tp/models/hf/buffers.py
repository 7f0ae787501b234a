"""Non-persistent buffers of a Hugging Face stage (rotary tables, embedding scales) after meta materialization.

transformers fills them in `_init_weights` (its own rule per module type); it would also re-draw the module's
parameters, so those are swapped for meta placeholders while it runs (values come later, by FQN).
"""

from __future__ import annotations

import torch
from torch import nn

from pp_tp._torch import is_persistent_buffer


@torch.no_grad()
def init_buffers(stage: nn.Module, model: nn.Module) -> None:
    """Recomputes every non-persistent buffer of `stage` with the model's own `_init_weights` rules."""
    for module in stage.modules():
        if all(is_persistent_buffer(module, n) for n, _ in module.named_buffers(recurse=False)):
            continue
        params = dict(module.named_parameters(recurse=False))
        for name, p in params.items():
            setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad))
        try:
            model._init_weights(module)
        finally:
            for name, p in params.items():
                setattr(module, name, p)
