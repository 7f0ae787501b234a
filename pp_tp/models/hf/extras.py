"""What a Hugging Face model's own forward computes outside its modules, before the blocks and after the head.

Each is read off the config attribute the modeling code uses; the self-check proves a family's composition
equal to its own forward, so an attribute used differently than here makes the family refused, not wrong.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pp_tp.models.hf import hyper

Transform = Callable[[torch.Tensor], torch.Tensor]


def after_embed(config) -> Transform | None:
    """Granite multiplies the embeddings by `embedding_multiplier` in the base model's forward; hyper-connection
    families (`hc_mult`: DeepSeek-V4, HY-V4) then copy them into the `[B, S, hc_mult, D]` residual stream."""
    steps: list[Transform] = []
    multiplier = getattr(config, "embedding_multiplier", None)
    if multiplier not in (None, 1.0):
        steps.append(lambda h: h * multiplier)
    n = hyper.streams(config)
    if n is not None:
        steps.append(hyper.expand(n))
    return _chain(steps)


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
    return _chain(steps)


def _chain(steps: list[Transform]) -> Transform | None:
    """The steps applied in order, or None for none."""
    if not steps:
        return None

    def apply(x: torch.Tensor) -> torch.Tensor:
        for step in steps:
            x = step(x)
        return x

    return apply
