"""Gradient reduction every k microbatches: a PipelineStage that reduce-scatters FSDP gradients after every
k-th microbatch backward of its stage, accumulating them sharded (`FsdpPolicy.grad_reduce_every`, from
`parallel.fsdp_grad_reduce`).

torch's PipelineStage turns FSDP gradient sync off for every backward and reduces once, after the last
microbatch (REDUCE_GRAD); unsharded gradients of the whole stage accumulate until then. Here the k-th,
2k-th, ... backward runs with sync on, so FSDP's own autograd hooks reduce-scatter each unit as soon as
its backward is done and free its unsharded gradient (FSDP2 adds the result to the sharded `.grad`);
the last microbatch's backward does too (with "step", only it: k = m), as plain FSDP2's one backward does, so no
unit keeps an unsharded copy of its gradients in the reduce dtype, and finalizes the step as torch's REDUCE_GRAD
would (which then has nothing left to do). A split backward (zero-bubble: input, then weight) reduces
right after the weight backward. Reduce-scatters per unit per step: ceil(m / k).
Home-made: torch's PipelineStage has no such option (backward_maybe_with_nosync syncs only at the end).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from pp_tp.base._torch import fsdp_reduce_grads_now, stage_backward
from pp_tp.config.fsdp_policy import FsdpPolicy


class ReducingStage(PipelineStage):
    """A PipelineStage whose FSDP submodule reduce-scatters after every k-th of `microbatches` backwards, k the
    rank's `policy.grad_reduce_every`.

    A reducing backward also reshards the parameters when the policy does not keep them gathered for the step,
    so between reductions a stage holds neither unsharded gradients nor parameters.
    """

    def __init__(self, *args: Any, policy: FsdpPolicy, microbatches: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        every = policy.grad_reduce_every or microbatches  # None ("step"): the last backward only
        self.every, self.microbatches, self.reshard = every, microbatches, policy.reshards_params
        self.backwards = 0  # "full" or "weight" backwards run in this step
        self.reduced = False  # the step's last backward reduced and finalized FSDP: REDUCE_GRAD has nothing to do

    def _sync_on(self, submod: FSDPModule, last: bool) -> None:
        """Sync on for this backward; the step's last one also finalizes, as torch's REDUCE_GRAD would."""
        submod.set_is_last_backward(last)
        submod.set_reshard_after_backward(self.reshard or last)
        submod.set_requires_gradient_sync(True)
        self.reduced = last

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """torch's REDUCE_GRAD: skipped where the last backward already reduced (a second post-backward pass over
        every unit would find nothing to reduce)."""
        if not self.reduced:
            super().perform_reduce_grad(grad_scale_factor)
        elif grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)
        self.reduced = False

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[Any, Any]:
        if backward_type == "input" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.backwards += 1
        n = self.backwards
        last = n >= self.microbatches
        if last:
            self.backwards = 0
        elif n % self.every:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type == "full":
            self._sync_on(self.submod, last)
            grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
            return grads, None
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self._sync_on(self.submod, last)
        fsdp_reduce_grads_now(self.submod)
        return result
