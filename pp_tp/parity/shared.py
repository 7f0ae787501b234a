"""A reference run stepped on one rank and mirrored on every other.

Lockstep's two references (the plain fp32 build and its float64 copy) compute the same numbers on every rank: on a
cluster every rank but one wastes that time, and in the CPU tests, where several ranks share a few cores, it was half
of a family case (measured: 14.7 of 28 s per rank for Qwen3-Next at pp2 x tp2). So each reference steps on one rank,
which broadcasts what the judges read (loss, clipped norm, gradients, parameters, persistent buffers), and every other
rank writes those into its own copy of the run: afterwards `losses`, `norms`, `grads()`, `params()` and `buffers()`
read the same on every rank. Optimizer state and non-persistent buffers stay the owner's alone.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from pp_tp.base.tensors import persistent_buffers


class ReferenceRun(Protocol):
    """What is stepped and mirrored here: lockstep.ReferenceRun (named by shape, as lockstep imports this module)."""

    model: nn.Module
    losses: list[float]
    norms: list[float]

    def step(self, *batch: torch.Tensor) -> float: ...
    def load(self, params: dict[str, torch.Tensor]) -> None: ...
    def grads(self) -> dict[str, torch.Tensor]: ...
    def params(self) -> dict[str, torch.Tensor]: ...
    def buffers(self) -> dict[str, torch.Tensor]: ...


def owners(world_covered: bool) -> tuple[int | None, int | None]:
    """The ranks stepping the fp32 and the float64 reference (two, so they step at once); None (every rank steps it
    itself) in a world of one rank or where the pipeline's mesh does not cover the whole world (then not every rank
    takes part)."""
    if not world_covered or not dist.is_initialized() or dist.get_world_size() < 2:
        return None, None
    return 1, 0


def step_on(owned: tuple[tuple[int | None, ReferenceRun], ...], batch: tuple[torch.Tensor, ...]) -> None:
    """Each (owner, run) `run.step(*batch)` on its owner rank (every rank for owner None), the owners at once, then
    mirrored from its owner into every other rank's copy. A step failing on its owner fails on every rank (its
    error is what the owner broadcasts), so no peer waits for a mirror that never comes."""
    failed: dict[int, str] = {}
    for owner, run in owned:
        if owner is None:
            run.step(*batch)
        elif dist.get_rank() == owner:
            try:
                run.step(*batch)
            except Exception as e:  # noqa: BLE001 - sent to every peer below, then raised everywhere
                failed[owner] = f"{type(e).__name__}: {e}"
    for owner, run in owned:
        if owner is None:
            continue
        payload: list[Any] = [None]
        if dist.get_rank() == owner:
            payload = [failed[owner]] if owner in failed else [_results(run)]
        dist.broadcast_object_list(payload, src=owner)
        if isinstance(payload[0], str):
            raise RuntimeError(f"the reference run stepped on rank {owner} failed: {payload[0]}")
        if dist.get_rank() != owner:
            _mirror(run, *payload[0])


def _results(run: ReferenceRun) -> tuple[Any, ...]:
    """What the judges read after a step, on the CPU (what a peer's copy is set to)."""
    return run.losses[-1], run.norms[-1:], _cpu(run.grads()), _cpu(run.params()), _cpu(run.buffers())


def load_on(owner: int | None, run: ReferenceRun, params: dict[str, torch.Tensor]) -> None:
    """`run.load(params)` where the run steps (a mirror's parameters come from its owner)."""
    if owner is None or dist.get_rank() == owner:
        run.load(params)


def _cpu(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """Detached CPU copies; None (a parameter no gradient reaches) stays None."""
    return {k: None if t is None else t.detach().cpu() for k, t in tensors.items()}


@torch.no_grad()
def _mirror(
    run: ReferenceRun,
    loss: float,
    norm: list[float],
    grads: dict[str, torch.Tensor | None],
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
) -> None:
    run.losses.append(loss)
    run.norms.extend(norm)
    for k, p in run.model.named_parameters():
        p.copy_(params[k])
        p.grad = None if grads[k] is None else grads[k].to(p.device, p.dtype)
    for k, b in persistent_buffers(run.model).items():
        b.copy_(buffers[k])
