"""Forward-only evaluation through the pipeline schedule (torch's `schedule.eval`): what `Pipeline.evaluate` needs.

The loss is the same exact token normalization as training (token-summed cross-entropy over the global
count of non-ignored tokens), so it equals the single-process model's mean loss on the same batch. It runs
under `no_grad` and asserts that no gradient was created or changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.distributed.pipelining.schedules import FORWARD, OVERLAP_F_B, RECV_F, RESHARD, SEND_F, UNSHARD

from pp_tp.base._torch import Action, PipelineScheduleRuntime, local_tensor, tensor_version


def grad_state(parts: list[nn.Module]) -> dict[str, tuple[int, int | None]]:
    """Each parameter's gradient identity and version: a changed version means something accumulated."""
    return {
        name: (id(p.grad), None if p.grad is None else tensor_version(local_tensor(p.grad)))
        for part in parts
        for name, p in part.named_parameters()
    }


_FORWARD_ONLY = (FORWARD, SEND_F, RECV_F, UNSHARD, RESHARD)


def _forward_part(a: Action) -> list[Action]:
    """The forward actions of one lowered action: itself, the F of an overlapped F+B, or nothing."""
    if a.computation_type == OVERLAP_F_B:
        return [s for s in a.sub_actions if s.computation_type == FORWARD]
    return [a] if a.computation_type in _FORWARD_ONLY else []


@contextlib.contextmanager
def forward_only(schedule: Any) -> Iterator[None]:
    """Multi-stage (runtime) schedules: torch's eval() still runs their backward actions, so the action
    lists keep only forwards, their sends/receives and FSDP unshard/reshard for the `with` block."""
    if not isinstance(schedule, PipelineScheduleRuntime):
        yield
        return
    order = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {r: [f for a in acts for f in _forward_part(a)] for r, acts in order.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = order


@contextlib.contextmanager
def kept_grads(parts: list[nn.Module]) -> Iterator[None]:
    """Every parameter's gradient as it was before the `with` block: torch re-initializes the stages when a schedule
    switches between train and eval, and that cleanup sets each FSDP parameter's grad to None
    (stage._post_metadata_inference_cleanup)."""
    grads = [(p, p.grad) for part in parts for p in part.parameters()]
    try:
        yield
    finally:
        for p, g in grads:
            p.grad = g
