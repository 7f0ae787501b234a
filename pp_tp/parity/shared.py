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


def owners(shared: bool) -> tuple[int | None, int | None]:
    """The ranks stepping the fp32 and the float64 reference (two, so they step at once); None (every rank steps it
    itself) without `shared` or in a world of one rank. Every rank takes part: lockstep judges pipelines whose mesh
    covers the world (`PipelineRun.assembled`)."""
    if not shared or not dist.is_initialized() or dist.get_world_size() < 2:
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
        mine = dist.get_rank() == owner
        head: list[Any] = [None]
        if mine:
            head = [failed[owner]] if owner in failed else [(run.losses[-1], run.norms[-1:], _has_grad(run))]
        dist.broadcast_object_list(head, src=owner)
        if isinstance(head[0], str):
            raise RuntimeError(f"the reference run stepped on rank {owner} failed: {head[0]}")
        loss, norm, has_grad = head[0]
        tensors = _judged(run) if mine else _slots(run, has_grad)
        _broadcast_flat(tensors, owner)
        if not mine:
            _mirror(run, loss, norm, has_grad, tensors)


def _has_grad(run: ReferenceRun) -> list[bool]:
    """Per parameter (named_parameters' order), whether a gradient reached it."""
    return [g is not None for g in run.grads().values()]


def _judged(run: ReferenceRun) -> list[torch.Tensor]:
    """What the judges read after a step, on the CPU: the gradients that exist, the parameters, the persistent
    buffers, each in named order (the order `_slots` receives them in)."""
    grads = [g for g in run.grads().values() if g is not None]
    return [t.detach().cpu() for t in (*grads, *run.params().values(), *run.buffers().values())]


def _slots(run: ReferenceRun, has_grad: list[bool]) -> list[torch.Tensor]:
    """Empty CPU tensors shaped as `_judged`'s on the owner: a peer's copy has the same parameters and buffers."""
    params = [p for _, p in run.model.named_parameters()]
    grads = [p for p, has in zip(params, has_grad, strict=True) if has]
    like = (*grads, *params, *persistent_buffers(run.model).values())
    return [torch.empty(t.shape, dtype=t.dtype) for t in like]


def _broadcast_flat(tensors: list[torch.Tensor], src: int) -> None:
    """`tensors` from `src` into every other rank's, one flat broadcast per dtype (pickling them, as
    broadcast_object_list did, cost a copy on each side and a collective per object; one per tensor, a collective
    each)."""
    # NCCL (the default group on CUDA) sends only tensors on the rank's current CUDA device.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, group in by_dtype.items():
        flat = torch.cat([t.reshape(-1) for t in group]).to(device) if dist.get_rank() == src else None
        if flat is None:
            flat = torch.empty(sum(t.numel() for t in group), dtype=dtype, device=device)
        wire = flat.view(torch.uint8) if dtype == torch.bool else flat  # gloo sends bytes, not bools
        dist.broadcast(wire, src=src)
        if dist.get_rank() != src:
            for t, part in zip(group, flat.split([t.numel() for t in group]), strict=True):
                t.copy_(part.view(t.shape))


def load_on(owner: int | None, run: ReferenceRun, params: dict[str, torch.Tensor]) -> None:
    """`run.load(params)` where the run steps (a mirror's parameters come from its owner)."""
    if owner is None or dist.get_rank() == owner:
        run.load(params)


@torch.no_grad()
def _mirror(
    run: ReferenceRun, loss: float, norm: list[float], has_grad: list[bool], tensors: list[torch.Tensor]
) -> None:
    """A peer's copy set to its owner's step: `tensors` as `_judged` lists them."""
    run.losses.append(loss)
    run.norms.extend(norm)
    params = [p for _, p in run.model.named_parameters()]
    received = iter(tensors)
    grads = [next(received) if has else None for has in has_grad]
    for p, g in zip(params, grads, strict=True):
        p.copy_(next(received))
        p.grad = None if g is None else g.to(p.device, p.dtype)
    for b in persistent_buffers(run.model).values():
        b.copy_(next(received))
