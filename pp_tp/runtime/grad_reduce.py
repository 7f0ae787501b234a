"""Gradient reduction every k microbatches: a PipelineStage that reduce-scatters FSDP gradients after every
k-th microbatch backward of its stage, accumulating them sharded (`FsdpPolicy.grad_reduce_every`, from
`parallel.fsdp_grad_reduce`).

torch's PipelineStage turns FSDP gradient sync off for every backward and reduces once, after the last
microbatch (REDUCE_GRAD); unsharded gradients of the whole stage accumulate until then. Here the k-th,
2k-th, ... backward runs with sync on, so FSDP's own autograd hooks reduce-scatter each unit as soon as
its backward is done and free its unsharded gradient (FSDP2 adds the result to the sharded `.grad`);
the last microbatch stays torch's REDUCE_GRAD. A split backward (zero-bubble: input, then weight) reduces
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
        self.every, self.microbatches, self.reshard = policy.grad_reduce_every, microbatches, policy.reshards_params
        self.backwards = 0  # "full" or "weight" backwards run in this step

    def _sync_on(self, submod: FSDPModule) -> None:
        submod.set_is_last_backward(False)
        submod.set_reshard_after_backward(self.reshard)
        submod.set_requires_gradient_sync(True)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[Any, Any]:
        if backward_type == "input" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.backwards += 1
        n = self.backwards
        if n >= self.microbatches:
            self.backwards = 0  # torch's REDUCE_GRAD then finds nothing left to reduce, and reshards
        elif n % self.every:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type == "full":
            self._sync_on(self.submod)
            grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
            return grads, None
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self._sync_on(self.submod)
        fsdp_reduce_grads_now(self.submod)
        return result
