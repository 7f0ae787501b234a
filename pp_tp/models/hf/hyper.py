"""Hyper-connections (DeepSeek-V4, HY-V4): the residual stream between layers is `[B, S, hc_mult, D]`.

The family's config declares `hc_mult`; its base model's forward copies the embedding into `hc_mult` streams before
the first layer and collapses them with one weighted module (`hc_head`) right before the final norm. pp_tp keeps
the layers as they are, so a stage boundary carries the 4-D stream as one plain tensor: the first stage expands
after the embedding (a parameterless step, `expand`), the last stage holds and runs the collapse before its norm.
The collapse is found as the one module with weights outside embedding, layers and norm of a model declaring
`hc_mult`; the self-check then proves `norm(collapse(h))` equal to the model's own forward, or refuses the family.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def streams(config) -> int | None:
    """The residual stream count a hyper-connection family declares (`hc_mult`), None for every other family."""
    n = getattr(config, "hc_mult", None)
    return n if isinstance(n, int) and n >= 1 else None


def expand(n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The base model's step after the embedding: each token's embedding copied into `n` streams, as a contiguous
    `[B, S, n, D]` tensor (the layers write the streams apart)."""
    return lambda h: h.unsqueeze(2).expand(-1, -1, n, -1).contiguous()


def collapse_modules(config, weighted: list[str]) -> tuple[str, ...]:
    """Names (the base model's children) of the weighted modules run on the stream before the final norm: for a
    model declaring `hc_mult`, its one weighted module outside embedding/layers/norm; none otherwise (or when it has
    several, which stay refused)."""
    if streams(config) is None or len(weighted) != 1:
        return ()
    return tuple(weighted)
