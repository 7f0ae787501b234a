"""Per-rank memory: parameter, gathered-copy, gradient, optimizer and activation bytes of one pp rank."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.schedules import BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, OVERLAP_F_B
from torch.distributed.tensor import DTensor

from pp_tp._torch import Action, FakeTensorMode
from pp_tp.config import ParallelConfig
from pp_tp.parallel.apply import parallelize_stage
from pp_tp.parallel.fsdp import uses_fsdp
from pp_tp.planner.activations import stage_activation_bytes
from pp_tp.stages.stage_module import StageModule

FP32 = 4
ADAM_STATES = 2  # exp_avg and exp_avg_sq, fp32, on the local shard
_DP_DIMS = ("dp_replicate", "dp_shard")


@dataclass
class RankMemory:
    """Bytes one rank of a pp stage group holds (at dp/tp coordinate 0)."""

    pp_rank: int
    stages: list[int]
    local_params: int
    param_bytes: int
    gathered_bytes: int
    grad_bytes: int
    grad_accum_bytes: int
    optim_bytes: int
    act_bytes_per_microbatch: dict[int, int]
    act_peak_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Everything the rank holds at its peak, to compare against the device's memory."""
        return (
            self.param_bytes
            + self.gathered_bytes
            + self.grad_bytes
            + self.grad_accum_bytes
            + self.optim_bytes
            + self.act_peak_bytes
        )


@dataclass(frozen=True)
class StageCost:
    """What one stage costs a rank: local parameter elements, their TP-local (DP-gathered) count, and the
    saved activations of one microbatch."""

    local: int
    tp_local: int
    act_bytes: int


def tp_local_numel(p: torch.Tensor) -> int:
    """Elements of the parameter as one TP rank computes with it (all-gathered over DP, still TP-sharded)."""
    if not isinstance(p, DTensor):
        return p.numel()
    names = p.device_mesh.mesh_dim_names or ()
    split = 1
    for i, placement in enumerate(p.placements):
        if placement.is_shard() and (i >= len(names) or names[i] not in _DP_DIMS):
            split *= p.device_mesh.size(i)
    return p.numel() // split


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def stage_cost(
    stage: StageModule,
    mesh: DeviceMesh,
    pcfg: ParallelConfig,
    microbatch: int,
    seq: int,
    dim: int,
    fake: FakeTensorMode,
) -> StageCost:
    """Parallelizes `stage` on meta (the real passes, on the fake world's mesh) and measures it."""
    parallelize_stage(stage, mesh, pcfg)
    local = sum(_local_numel(p) for p in stage.parameters())
    with fake, warnings.catch_warnings():  # one mode for all stages: shared modules (rotary tables) stay in it
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # the output view is never modified
        acts = stage_activation_bytes(stage, mesh, pcfg, microbatch, seq, dim)
    return StageCost(local, sum(tp_local_numel(p) for p in stage.parameters()), acts)


def rank_memory(pp_rank: int, stages: list[int], costs: list[StageCost], pcfg: ParallelConfig) -> RankMemory:
    """Parameter, gathered-copy, gradient, optimizer and activation bytes of one pp rank's stages."""
    local = sum(c.local for c in costs)
    gathered_bytes = grad_accum_bytes = 0
    if uses_fsdp(pcfg):
        # torch's PipelineStage runs every backward with reshard_after_backward and gradient sync off, so
        # whatever the reshard policy each unit stays gathered (param dtype) from its first backward, and
        # its unsharded gradients accumulate (fp32), until the step's one gradient reduction.
        tp_local = sum(c.tp_local for c in costs)
        gathered_bytes = (2 if pcfg.mixed_precision == "bf16" else FP32) * tp_local
        grad_accum_bytes = FP32 * tp_local
    return RankMemory(
        pp_rank,
        stages,
        local,
        param_bytes=local * FP32,
        gathered_bytes=gathered_bytes,
        grad_bytes=local * FP32,
        grad_accum_bytes=grad_accum_bytes,
        optim_bytes=ADAM_STATES * local * FP32,
        act_bytes_per_microbatch={s: c.act_bytes for s, c in zip(stages, costs)},
    )


def peak_held_bytes(actions: list[Action], bytes_per_stage: dict[int, int]) -> int:
    """Most activation bytes a rank holds at once running `actions`: forwards add, full/weight backwards free."""
    held = peak = 0
    for action in actions:
        for a in action.sub_actions if action.computation_type == OVERLAP_F_B else (action,):
            if a.computation_type == FORWARD:
                held += bytes_per_stage[a.stage_index]
            elif a.computation_type in (FULL_BACKWARD, BACKWARD_WEIGHT):
                held -= bytes_per_stage[a.stage_index]
            peak = max(peak, held)
    return peak
