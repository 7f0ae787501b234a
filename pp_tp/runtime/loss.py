"""Exact loss normalization: token-summed cross-entropy over the global count of non-ignored tokens.

A mean per microbatch, averaged over microbatches and DP ranks, weights a token by how full its
microbatch was: with uneven padding the loss and gradients drift from the single-process build
(torchtitan issues 1733 and 2972). Here every microbatch's loss is its token *sum* divided by the
*global* token count, so sums over microbatches and ranks are exact; the schedule runs with
``scale_grads=False`` so nothing divides twice.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from pp_tp.tensor_utils import full_tensor

IGNORE_INDEX = -100


class TokenSumLoss:
    """Microbatch loss = sum of token CE * `scale`, where `scale` = grad_factor / global token count.

    `grad_factor` undoes the mean FSDP takes over DP ranks when it reduces gradients (gloo refuses
    FSDP's PREMUL_SUM divide factor, so the correction lives in the loss). With a `tp_mesh` (loss
    parallel), the logits arrive as this TP rank's vocabulary shard and the cross-entropy runs
    vocab-parallel; the caller must hold `parallel()` around both the loss and its backward.
    """

    def __init__(self, tp_mesh: DeviceMesh | None = None):
        self.scale = 1.0
        self.tp_mesh = tp_mesh

    def parallel(self) -> contextlib.AbstractContextManager:
        """torch's loss_parallel() when the logits are vocab-sharded, else nothing.

        Its backward ops are only vocab-parallel inside the context (outside, DTensor would gather the
        full vocabulary), and it must not nest (leaving an inner one disables the outer), so the
        Pipeline enters it once around the whole schedule step.
        """
        return loss_parallel() if self.tp_mesh is not None else contextlib.nullcontext()

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is not None:
            logits = DTensor.from_local(logits, self.tp_mesh, [Shard(-1)], run_check=False)
        ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        return full_tensor(ce) * self.scale


def count_tokens(labels: torch.Tensor, dp_groups: list[dist.ProcessGroup]) -> int:
    """Non-ignored label tokens in the global batch (all microbatches, all DP ranks)."""
    n = (labels != IGNORE_INDEX).sum().to(torch.float64).reshape(1)
    for g in dp_groups:
        dist.all_reduce(n, group=g)
    return int(n.item())
