"""The non-finite guard: a NaN/Inf loss or gradient norm stops the run on every rank with one line naming
the step and the stage (and its ranks) where it appeared, or skips the step (`training.skip_nonfinite`).

The decision needs no extra collective: the loss and the grad norm are already global and equal on every
rank, so every rank sees the same non-finite value and takes the same branch. Only then do the ranks
gather their per-stage flags (one all_gather) to name the origin: the first stage whose forward output
went non-finite, or, when every forward was finite, the last stage whose gradients did (backward runs
from the last stage down).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from pp_tp.base._torch import local_tensor


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm under `training.skip_nonfinite = false`; the same line on every rank."""


class NonFiniteGuard:
    """Watches this rank's stages: a forward hook ORs `not isfinite(output).all()` into a per-stage flag
    (on the device, no host sync), reset by `begin_step`."""

    def __init__(self, parts: list[nn.Module], num_stages: int, device: torch.device):
        self.parts, self.num_stages = parts, num_stages
        self.flags = torch.zeros(2, num_stages, dtype=torch.bool, device=device)  # [forward, grads] x stages
        for part in parts:
            part.register_forward_hook(self._hook(part.spec.index))

    def _hook(self, index: int):
        def hook(_module: nn.Module, _args, out: torch.Tensor) -> None:
            self.flags[0, index] |= ~torch.isfinite(out.detach()).all()

        return hook

    def begin_step(self) -> None:
        self.flags.zero_()

    def where(self) -> str:
        """Where the non-finite values appeared: a collective every rank calls once it saw one."""
        for part in self.parts:
            grads = [local_tensor(p.grad) for p in part.parameters() if p.grad is not None]
            self.flags[1, part.spec.index] = any(bool((~torch.isfinite(g)).any()) for g in grads)
        everyone = [torch.zeros_like(self.flags) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, self.flags)
        seen = torch.stack(everyone).cpu()  # [rank, kind, stage]
        forward = [s for s in range(self.num_stages) if seen[:, 0, s].any()]
        backward = [s for s in range(self.num_stages) if seen[:, 1, s].any()]
        if forward:
            stage, what = forward[0], "output"
        elif backward:
            stage, what = backward[-1], "gradients"
        else:
            return "the loss itself (every stage's output and gradients finite)"
        ranks = [r for r in range(len(everyone)) if seen[r, 0 if what == "output" else 1, stage]]
        return f"stage {stage} {what} (ranks {', '.join(map(str, ranks))})"


def describe(step: int, loss: float, grad_norm: float, where: str) -> str:
    """The one line every rank prints or raises."""
    return f"step {step}: non-finite loss {loss} / grad_norm {grad_norm}, first at {where}"


def is_finite(loss: float, grad_norm: float) -> bool:
    return math.isfinite(loss) and math.isfinite(grad_norm)
