"""What a Hugging Face model's own forward computes outside its modules, before the blocks and after the head.

Each is read off the config attribute the modeling code uses; the self-check proves a family's composition
equal to its own forward, so an attribute used differently than here makes the family refused, not wrong.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Transform = Callable[[torch.Tensor], torch.Tensor]


def after_embed(config) -> Transform | None:
    """Granite multiplies the embeddings by `embedding_multiplier` in the base model's forward."""
    multiplier = getattr(config, "embedding_multiplier", None)
    if multiplier is None or multiplier == 1.0:
        return None
    return lambda h: h * multiplier


def after_head(config) -> Transform | None:
    """Logit transforms of the *ForCausalLM forward: Granite divides by `logits_scaling`, Cohere multiplies by
    `logit_scale`, Gemma 2/3 softcap with `final_logit_softcapping`."""
    steps: list[Transform] = []
    scaling = getattr(config, "logits_scaling", None)
    if scaling not in (None, 1.0):
        steps.append(lambda x: x / scaling)
    scale = getattr(config, "logit_scale", None)
    if scale not in (None, 1.0):
        steps.append(lambda x: x * scale)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        steps.append(lambda x: torch.tanh(x / cap) * cap)
    if not steps:
        return None

    def apply(x: torch.Tensor) -> torch.Tensor:
        for step in steps:
            x = step(x)
        return x

    return apply
