"""Hyper-connections (DeepSeek-V4, HY-V4): the residual stream between layers is `[B, S, hc_mult, D]`.

The family's config declares `hc_mult`; its base model's forward copies the embedding into `hc_mult` streams before
the first layer and collapses them with one weighted module (`hc_head`) right before the final norm. pp_tp keeps
the layers as they are, so a stage boundary carries the 4-D stream as one plain tensor: the first stage expands
after the embedding (a parameterless step, `expand`), the last stage holds and runs the collapse before its norm.
The collapse is found as the one module with weights outside embedding, layers and norm of a model declaring
`hc_mult`; the self-check then proves `norm(collapse(h))` equal to the model's own forward, or refuses the family.

Qwen4-Exp declares `hc_count` and keeps the streams flat, `[B, S, hc_count * D]` (the embedding repeated along the
hidden axis), its layers reading and writing that flat tensor and its last module (`hyper_connection_mixer`, taken as
the norm) collapsing it. Its stage boundaries carry the same values viewed `[B, S, hc_count, D]`, so one boundary
shape serves both forms: `flat_call` hands each layer the flat view and returns its output viewed back (views only),
`flatten` undoes the view before the last stage's norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _declared(config, key: str) -> int | None:
    """The config's positive integer `key`, None where it declares none."""
    n = getattr(config, key, None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def streams(config) -> int | None:
    """The residual stream count a hyper-connection family declares (`hc_mult` stacked, `hc_count` flat), None for
    every other family."""
    return _declared(config, "hc_mult") or _declared(config, "hc_count")


def flat(config) -> bool:
    """Whether the layers take the streams flat, `[B, S, n * D]` (`hc_count` without `hc_mult`)."""
    return _declared(config, "hc_mult") is None and _declared(config, "hc_count") is not None


def expand(config) -> Callable[[torch.Tensor], torch.Tensor]:
    """The base model's step after the embedding: each token's embedding copied into `n` streams, as a contiguous
    `[B, S, n, D]` tensor (the layers write the streams apart), or `[B, S, n * D]` for the flat form."""
    n = streams(config)
    if flat(config):
        return lambda h: h.repeat(1, 1, n)
    return lambda h: h.unsqueeze(2).expand(-1, -1, n, -1).contiguous()


def flat_call(inner: Callable[..., torch.Tensor], n: int) -> Callable[..., torch.Tensor]:
    """`call_block` for the flat form with `n` streams: the layer gets the stream flat (as the first layer does
    straight after the embedding) and its output goes on viewed `[B, S, n, D]`, the boundary's shape."""

    def call_block(block: torch.nn.Module, h: torch.Tensor, extras: Any, index: int, **handed: Any) -> torch.Tensor:
        out = inner(block, flatten(h), extras, index, **handed)
        return out.unflatten(-1, (n, -1))

    return call_block


def flatten(h: torch.Tensor) -> torch.Tensor:
    """The last stage's step before its norm (the flat form's collapse): the stream flat again."""
    return h.flatten(2) if h.dim() == 4 else h


def collapse_modules(config, weighted: list[str]) -> tuple[str, ...]:
    """Names (the base model's children) of the weighted modules run on the stream before the final norm: for a
    model declaring `hc_mult`, its one weighted module outside embedding/layers/norm; none otherwise (or when it has
    several, which stay refused)."""
    if streams(config) is None or len(weighted) != 1:
        return ()
    return tuple(weighted)


def stream_calls(config, call: Callable[..., torch.Tensor]) -> dict[str, Any]:
    """The layout's `call_block`, and the last edge's step before the norm, for the stream: the flat form's view
    steps, else `call` as is."""
    if flat(config):
        return dict(call_block=flat_call(call, streams(config)), before_norm=flatten)
    return dict(call_block=call, before_norm=None)
