"""Forward-only evaluation through the pipeline schedule (torch's `schedule.eval`): the validation loss.

The loss is the same exact token normalization as training (token-summed cross-entropy over the global
count of non-ignored tokens), so it equals the single-process model's mean loss on the same batch. It runs
under `no_grad` and asserts that no gradient was created or changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.distributed.pipelining.schedules import FORWARD, OVERLAP_F_B, RECV_F, RESHARD, SEND_F, UNSHARD

from pp_tp._torch import Action, PipelineScheduleRuntime, local_tensor, tensor_version

if TYPE_CHECKING:
    from pp_tp.schedules.pipeline import Pipeline


def _grad_state(pipe: Pipeline) -> dict[str, tuple[int, int | None]]:
    """Each parameter's gradient identity and version: a changed version means something accumulated."""
    return {
        name: (id(p.grad), None if p.grad is None else tensor_version(local_tensor(p.grad)))
        for part in pipe.model_parts
        for name, p in part.named_parameters()
    }


_FORWARD_ONLY = (FORWARD, SEND_F, RECV_F, UNSHARD, RESHARD)


def _forward_part(a: Action) -> list[Action]:
    """The forward actions of one lowered action: itself, the F of an overlapped F+B, or nothing."""
    if a.computation_type == OVERLAP_F_B:
        return [s for s in a.sub_actions if s.computation_type == FORWARD]
    return [a] if a.computation_type in _FORWARD_ONLY else []


@contextlib.contextmanager
def _forward_only(schedule) -> Iterator[None]:
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


@torch.no_grad()
def evaluate(pipe: Pipeline, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The global mean token loss of this DP rank's batch share, forward only; every rank calls it."""
    input_ids, labels, n_tokens = pipe.prepare_batch("Pipeline.evaluate", input_ids, labels)
    before = _grad_state(pipe)
    scale = pipe._loss.scale
    pipe._loss.scale = 1.0 / max(n_tokens, 1)  # nothing flows back, so no FSDP mean to undo
    losses: list[torch.Tensor] = []
    args = (input_ids,) if pipe.has_first_stage else ()
    # torch re-initializes the stages when a schedule switches between train and eval, and that cleanup
    # sets every FSDP parameter's grad to None (stage._post_metadata_inference_cleanup): put them back.
    grads = [(p, p.grad) for part in pipe.model_parts for p in part.parameters()]
    try:
        with pipe._loss.parallel(), _forward_only(pipe.schedule):
            pipe.schedule.eval(*args, target=labels if pipe.has_last_stage else None, losses=losses,
                               return_outputs=False)  # fmt: skip
    finally:
        pipe._loss.scale = scale
        for p, g in grads:
            p.grad = g
    changed = [k for k, v in _grad_state(pipe).items() if before[k] != v]
    if changed:
        raise AssertionError(f"Pipeline.evaluate changed the gradient of {changed[0]}; it must be forward-only")
    return pipe.global_loss(losses)
