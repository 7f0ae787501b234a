"""The tests' AdamW (parity_utils.adamw's hyperparameters) with foreach on: one op per parameter group instead of one
per parameter. On CPU torch does not pick foreach by default, and each op on a DTensor parameter pays DTensor's
sharding propagation: the single-tensor AdamW was a quarter of test_moe_balancing's time. A foreach op takes tensors
of one kind, so the parameters are grouped: one group per DTensor mesh, one for plain tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def grouped_adamw(lr: float = 1e-3, weight_decay: float = 0.1) -> Callable[[Iterable], torch.optim.AdamW]:
    """An optimizer factory like parity_utils.adamw (ReferenceRun and PipelineRun take one)."""

    def make(params: Iterable[torch.nn.Parameter]) -> torch.optim.AdamW:
        groups: dict = {}
        for p in params:
            groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
        return torch.optim.AdamW(
            [{"params": g} for g in groups.values()], lr=lr, weight_decay=weight_decay, foreach=True
        )

    return make
