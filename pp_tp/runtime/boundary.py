"""What crosses each stage boundary for one microbatch, given to torch's PipelineStage up front (static metadata).

A language model's boundaries are known from its dims (`BoundaryShapes`: ids in, `[microbatch, seq, hidden]`
between, logits out). Any other model's are found once per microbatch input shape and dtype by running every
stage's forward on a meta copy of the model (`InferredShapes`): no communication and no memory, and still one
plain tensor of any shape and dtype per boundary.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from pp_tp.layout import ModelLayout
from pp_tp.split.plan import StagePlan
from pp_tp.stages.stage_module import StageModule


@dataclass(frozen=True)
class BoundaryShapes:
    """What flows between stages for one microbatch: ids in, hidden states between, logits out."""

    microbatch: int
    seq: int
    dim: int
    vocab_local: int
    act_dtype: torch.dtype
    streams: int = 1  # > 1: hyper-connections' [microbatch, seq, streams, hidden] between stages

    def stage_io(self, stage: StageModule) -> tuple[torch.Tensor, torch.Tensor]:
        mb, s = self.microbatch, self.seq
        hidden = (mb, s, self.dim) if self.streams == 1 else (mb, s, self.streams, self.dim)
        inp = (
            torch.empty(mb, s, dtype=torch.long, device="meta")
            if stage.is_first
            else torch.empty(hidden, dtype=self.act_dtype, device="meta", requires_grad=True)
        )
        # requires_grad tells torch's static metadata that gradients flow back across the boundary.
        out = torch.empty(
            (mb, s, self.vocab_local) if stage.is_last else hidden,
            dtype=self.act_dtype,
            device="meta",
            requires_grad=True,
        )
        return inp, out


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of `model` on the meta device, made without copying any weight (tied tensors stay tied). Taken before
    the stages are materialized, which replaces the model's own tensors."""
    memo: dict[int, torch.Tensor] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def _boundary(t: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor like `t` as it crosses a boundary: fp32 activations (what the fp32 skeleton computes) in the
    compute dtype, other dtypes as they are; floating ones carry a gradient back."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"a stage returned a {type(t).__name__}; stage boundaries carry one plain tensor")
    dtype = act_dtype if t.dtype == torch.float32 else t.dtype
    return torch.empty(t.shape, dtype=dtype, device="meta", requires_grad=t.is_floating_point())


class InferredShapes:
    """Every stage's input and output for one microbatch input shape and dtype, from a meta forward of all stages."""

    def __init__(
        self,
        skeleton: nn.Module,
        layout: ModelLayout,
        plan: StagePlan,
        microbatch: tuple[int, ...],
        dtype: torch.dtype,
        act_dtype: torch.dtype,
    ):
        h = torch.empty(microbatch, dtype=dtype, device="meta")
        self._io: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad():
            for spec in plan.stages:
                out = StageModule(skeleton, layout, spec)(h)
                self._io[spec.index] = (h if spec.embed else _boundary(h, act_dtype), _boundary(out, act_dtype))
                h = out

    def stage_io(self, stage: StageModule) -> tuple[torch.Tensor, torch.Tensor]:
        return self._io[stage.spec.index]
