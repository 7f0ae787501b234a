"""What a Hugging Face model's own forward computes outside its modules, before the blocks and after the head.

Each is read off the config attribute the modeling code uses, never off an alias a config's `attribute_map` points
elsewhere (Inkling maps `embedding_multiplier` to the divisor of its last hidden state); the self-check proves a
family's composition equal to its own forward, so an attribute used differently than here makes the family refused,
not wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pp_tp.models.hf import hyper

Transform = Callable[[torch.Tensor], torch.Tensor]


def _own(config: Any, key: str) -> Any:
    """The config's own value of `key`; None where `key` only aliases another attribute (`attribute_map`)."""
    return None if key in (getattr(config, "attribute_map", None) or {}) else getattr(config, key, None)


def after_embed(config) -> Transform | None:
    """Granite multiplies the embeddings by `embedding_multiplier` in the base model's forward; hyper-connection
    families (`hc_mult`: DeepSeek-V4, HY-V4; `hc_count`: Qwen4-Exp, flat) then copy them into the residual streams."""
    steps: list[Transform] = []
    multiplier = _own(config, "embedding_multiplier")
    if multiplier not in (None, 1.0):
        steps.append(lambda h: h * multiplier)
    if hyper.streams(config) is not None:
        steps.append(hyper.expand(config))
    return _chain(steps)


def after_head(config) -> Transform | None:
    """Logit transforms of the *ForCausalLM forward: Granite divides by `logits_scaling`, Cohere multiplies by
    `logit_scale`, Gemma 2/3 softcap with `final_logit_softcapping` (xLSTM with `output_logit_soft_cap`,
    RecurrentGemma with `logits_soft_cap`); Inkling
    divides the last hidden state by `logits_mup_width_multiplier` before its bias-free head, the same as dividing the
    logits (the self-check proves it, a head with a bias included)."""
    steps: list[Transform] = []
    for key in ("logits_scaling", "logits_mup_width_multiplier"):
        divisor = _own(config, key)
        if divisor not in (None, 1.0):
            steps.append(lambda x, d=divisor: x / d)
    scale = _own(config, "logit_scale")
    if scale not in (None, 1.0):
        steps.append(lambda x: x * scale)
    for key in ("final_logit_softcapping", "output_logit_soft_cap", "logits_soft_cap"):
        cap = _own(config, key)
        if cap is not None:
            steps.append(lambda x, c=cap: torch.tanh(x / c) * c)
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
