"""Parameter init that depends on (seed, FQN) only, never on the parallel layout.

Every rank computes the full value of each parameter it holds from its full-model name and slices its
shard out locally, so any pp/tp/dp split reproduces the single-process init exactly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn

from pp_tp.base.tensors import copy_full_

# fqn, n_layers -> std; None means "ones" (norm weights), 0.0 zeros.
InitStd = Callable[[str, int], "float | None"]


def default_init_std(fqn: str, n_layers: int) -> float | None:
    """Norm weights ones, biases zeros, everything else N(0, 0.02)."""
    if fqn.endswith("norm.weight"):
        return None
    if fqn.endswith(".bias"):
        return 0.0
    return 0.02


def seed_of(seed: int, key: str) -> int:
    """A generator seed from (seed, key) alone: a hash, so nearby keys or seeds give unrelated streams."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_generator(seed: int, key: str) -> torch.Generator:
    """A CPU generator seeded by (seed, key) alone (`seed_of`)."""
    return torch.Generator().manual_seed(seed_of(seed, key))


def seeded_value(seed: int, fqn: str, shape: torch.Size, std: float | None) -> torch.Tensor:
    """The full fp32 value of one parameter, a function of (seed, fqn) only."""
    if std is None:
        return torch.ones(shape)
    if std == 0.0:
        return torch.zeros(shape)
    return torch.randn(shape, generator=seeded_generator(seed, fqn)) * std


@torch.no_grad()
def init_weights(module: nn.Module, seed: int, n_layers: int, std_rule: InitStd = default_init_std) -> None:
    """Initializes every parameter of ``module`` (a full model or a stage of one) by (seed, FQN)."""
    for fqn, p in module.named_parameters():
        copy_full_(p, seeded_value(seed, fqn, p.shape, std_rule(fqn, n_layers)))
