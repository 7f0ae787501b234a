"""Exact loss normalization: token-summed cross-entropy over the global count of non-ignored tokens, or the
caller's summed loss over its global normalizer (`SumLoss`).

A mean per microbatch, averaged over microbatches and DP ranks, weights a token by how full its
microbatch was: with uneven padding the loss and gradients drift from the single-process build
(torchtitan issues 1733 and 2972). Here every microbatch's loss is its token *sum* divided by the
*global* token count, so sums over microbatches and ranks are exact; the schedule runs with
``scale_grads=False`` so nothing divides twice. Under context parallel each cp rank holds different tokens of the
same rows: the count runs over the cp ranks too, and FSDP's mean over dp_shard x cp is undone the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from pp_tp.base.tensors import at_least_fp32, full_tensor
from pp_tp.errors import ConfigError

IGNORE_INDEX = -100


def vocab_parallel(logits: torch.Tensor, tp_mesh: DeviceMesh | None) -> torch.Tensor:
    """The logits as a loss must see them: this rank's vocabulary shard as a DTensor (Shard(-1) over tp), or as
    they are when the head gathers them (or there is no TP)."""
    if tp_mesh is None:
        return logits
    return DTensor.from_local(logits, tp_mesh, [Shard(-1)], run_check=False)


class TokenSumLoss:
    """Microbatch loss = sum of token CE * `scale`, where `scale` = grad_factor / global token count.

    `grad_factor` undoes the mean FSDP takes over DP (and cp) ranks when it reduces gradients (gloo refuses
    FSDP's PREMUL_SUM divide factor, so the correction lives in the loss). With a `tp_mesh` (loss
    parallel), the logits arrive as this TP rank's vocabulary shard and the cross-entropy runs
    vocab-parallel; the caller must hold `parallel()` around both the loss and its backward.
    """

    def __init__(self, tp_mesh: DeviceMesh | None = None):
        self.scale: float | torch.Tensor = 1.0
        self.tp_mesh = tp_mesh

    def parallel(self) -> contextlib.AbstractContextManager:
        """torch's loss_parallel() when the logits are vocab-sharded, else nothing.

        Its backward ops are only vocab-parallel inside the context (outside, DTensor would gather the
        full vocabulary), and it must not nest (leaving an inner one disables the outer), so the
        Pipeline enters it once around the whole schedule step.
        """
        return loss_parallel() if self.tp_mesh is not None else contextlib.nullcontext()

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = vocab_parallel(logits, self.tp_mesh)
        logits = at_least_fp32(logits.flatten(0, 1))  # fp32 under bf16, float64 kept
        ce = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        return scaled(full_tensor(ce), self.scale)


def scaled(loss: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """`loss * scale` as a Python float scale multiplies (the scale rounded to the loss's opmath dtype: float32, or
    float64 for a float64 loss), also when `scale` is a float64 0-dim tensor on the device: no host read."""
    if not isinstance(scale, torch.Tensor):
        return loss * scale
    opmath = torch.float64 if loss.dtype == torch.float64 else torch.float32
    out = loss.to(opmath) * scale.to(opmath)
    return out if out.dtype == loss.dtype else out.to(loss.dtype)


def loss_scale(numerator: float, count: torch.Tensor | int) -> torch.Tensor | float:
    """`numerator / max(count, 1)`, in float64 on the device for a tensor count, as Python divides: the loss scale
    without a host read."""
    return numerator / count.clamp(min=1) if isinstance(count, torch.Tensor) else numerator / max(count, 1)


def count_tokens(labels: torch.Tensor, dp_groups: list[dist.ProcessGroup]) -> torch.Tensor:
    """Non-ignored label tokens in the global batch (all microbatches, all DP and cp ranks: `dp_groups`), a float64
    0-dim tensor on the labels' device: it stays there until someone logs it (no host sync in a step)."""
    n = (labels != IGNORE_INDEX).sum().to(torch.float64).reshape(1)
    for g in dp_groups:
        dist.all_reduce(n, group=g)
    return n.reshape(())


# Losses by name (TOML `[training] loss`), each with reduction="sum": the pipeline divides by the global normalizer.
LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mse": lambda out, tgt: F.mse_loss(out.float(), tgt.float(), reduction="sum"),
    "l1": lambda out, tgt: F.l1_loss(out.float(), tgt.float(), reduction="sum"),
    "cross_entropy": lambda out, tgt: F.cross_entropy(out.float(), tgt, ignore_index=IGNORE_INDEX, reduction="sum"),
}
NORMALIZERS = ("elements", "samples")


class SumLoss:
    """The caller's loss for `Pipeline.step(inputs, targets)`: `fn(output, target)` must return the microbatch's
    *sum* (reduction="sum"); the pipeline multiplies it by `scale` = grad_factor / the global normalizer, the count
    over all microbatches and DP ranks of "elements" (target elements; for integer targets those not -100, as
    cross_entropy's mean counts them) or "samples" (target rows). So loss and gradients are the plain model's
    `fn(model(x), y) / count(y)` on the whole batch, however it is split."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | str, normalizer: str = "elements"):
        if isinstance(fn, str) and fn not in LOSSES:
            raise ConfigError(f"training.loss = {fn!r} is unknown; use one of {', '.join(LOSSES)} or pass a callable")
        if normalizer not in NORMALIZERS:
            raise ConfigError(f"loss normalizer {normalizer!r} is unknown; use one of {', '.join(NORMALIZERS)}")
        self.fn = LOSSES[fn] if isinstance(fn, str) else fn
        self.normalizer = normalizer
        self.scale = 1.0

    def parallel(self) -> contextlib.AbstractContextManager:
        """Nothing to enter: the output reaches the loss whole."""
        return contextlib.nullcontext()

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return scaled(self.fn(output, target), self.scale)


def target_count(targets: torch.Tensor, normalizer: str) -> int:
    """One batch's share of the normalizer: its samples, or its target elements (integer ones not -100)."""
    if normalizer == "samples":
        return targets.shape[0]
    return int((targets != IGNORE_INDEX).sum()) if not targets.is_floating_point() else targets.numel()


def count_targets(targets: torch.Tensor, normalizer: str, dp_groups: list[dist.ProcessGroup]) -> torch.Tensor:
    """The normalizer over the global batch (all microbatches, all DP ranks), a float64 0-dim tensor on the device."""
    if normalizer == "samples" or targets.is_floating_point():  # known from the shape
        n = torch.full((1,), target_count(targets, normalizer), dtype=torch.float64, device=targets.device)
    else:
        n = (targets != IGNORE_INDEX).sum().to(torch.float64).reshape(1)
    for g in dp_groups:
        dist.all_reduce(n, group=g)
    return n.reshape(())
