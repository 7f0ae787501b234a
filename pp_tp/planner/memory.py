"""Per-rank memory: parameter, gathered-copy, gradient, optimizer and activation bytes of one pp rank."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.schedules import BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, OVERLAP_F_B
from torch.distributed.tensor import DTensor

from pp_tp.base._torch import Action, FakeTensorMode
from pp_tp.config import ParallelConfig
from pp_tp.config.fsdp_policy import FsdpPolicy, uses_fsdp
from pp_tp.layout import ModelDims
from pp_tp.planner.activations import stage_activation_bytes
from pp_tp.planner.context import held_mask_bytes
from pp_tp.planner.moe import balanced_routing
from pp_tp.planner.walk import StageBytes, Walk
from pp_tp.stages.stage_module import StageModule

FP32 = 4
ADAM_STATES = 2  # exp_avg and exp_avg_sq, fp32, on the local shard
_DP_DIMS = ("dp_replicate", "dp_shard", "dp_shard_mod_ep", "dp_shard_cp")  # FSDP's; "ep" splits experts like TP


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
    sizes: dict[int, StageBytes] = field(default_factory=dict)  # per stage, for walk_step
    policy: FsdpPolicy | None = None  # set by the caller once known: "auto" is chosen from the rest of this record
    act_peak_bytes: int = 0  # the coming-and-going parts at the rank's peak moment (walk_step)
    buffer_bytes: int = 0  # kept across steps: PipelineStage receive buffers (one per microbatch), cp's masks
    transient_bytes: int = 0  # gradients in flight during one microbatch's backward (the largest stage's)
    # foreach AdamW's temporary at the optimizer step (sqrt of exp_avg_sq): fp32, the size of a part's parameters
    optim_step_bytes: int = 0

    @property
    def fixed_bytes(self) -> int:
        """What does not come and go with the step walk: sharded state, receive buffers, backward transient."""
        return self.param_bytes + self.grad_bytes + self.optim_bytes + self.buffer_bytes + self.transient_bytes

    def peak(self, walk_peak: int) -> int:
        """The rank's peak given its step walk's: the fixed bytes plus the larger of the walk's coming-and-going
        bytes and the optimizer step's temporary (activations are gone by then)."""
        return self.fixed_bytes + max(walk_peak, self.optim_step_bytes)

    @property
    def total_bytes(self) -> int:
        """Everything the rank holds at its peak, to compare against the device's memory."""
        return self.peak(self.gathered_bytes + self.grad_accum_bytes + self.act_peak_bytes)


@dataclass(frozen=True)
class StageCost:
    """What one stage costs a rank: local parameter elements, their TP-local (DP-gathered) count and its
    largest FSDP unit's, and the saved activations of one microbatch."""

    local: int
    tp_local: int
    act_bytes: int
    unit_tp_local: int = 0
    buffer_bytes: int = 0  # per microbatch: the activation (non-first stage) and gradient (non-last) buffers
    transient_bytes: int = 0
    held_bytes: int = 0  # kept across steps whatever the microbatches: the masks context parallel caches


def tp_local_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The parameter's shape as one TP (and EP) rank computes with it: all-gathered over DP, still TP/EP-sharded."""
    if not isinstance(p, DTensor):
        return tuple(p.shape)
    names = p.device_mesh.mesh_dim_names or ()
    shape = list(p.shape)
    for i, placement in enumerate(p.placements):
        dim = getattr(placement, "dim", None)  # Shard and _StridedShard
        if dim is not None and (i >= len(names) or names[i] not in _DP_DIMS):
            shape[dim] //= p.device_mesh.size(i)
    return tuple(shape)


def tp_local_numel(p: torch.Tensor) -> int:
    """Elements of the parameter as one TP rank computes with it (all-gathered over DP, still TP-sharded)."""
    return math.prod(tp_local_shape(p))


def is_expert(p: torch.Tensor) -> bool:
    """An expert-parallel parameter: FSDP shards it over what EP leaves of dp_shard (pp_tp.parallel.fsdp)."""
    return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def stage_cost(
    stage: StageModule,
    mesh: DeviceMesh,
    pcfg: ParallelConfig,
    microbatch: int,
    seq: int,
    dims: ModelDims,
    fake: FakeTensorMode,
) -> StageCost:
    """Measures `stage`, built on meta on the fake world's mesh (pp_tp.planner.stage_build)."""
    local = sum(_local_numel(p) for p in stage.parameters())
    blocks = [sum(tp_local_numel(p) for p in b.parameters()) for b in stage.block_modules()]
    tp_local = sum(tp_local_numel(p) for p in stage.parameters())
    # one mode for all stages: shared modules (rotary tables) stay in it
    with fake, balanced_routing(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # the output view is never modified
        saved = stage_activation_bytes(stage, mesh, pcfg, microbatch, seq, dims.dim)
    buffers, transient = boundary_extras(stage.is_first, stage.is_last, pcfg, microbatch, seq, dims)
    unit = max([*blocks, tp_local - sum(blocks)])
    return StageCost(local, tp_local, saved.act, unit, buffers, transient + saved.recompute, held_mask_bytes(stage))


def boundary_extras(
    first: bool, last: bool, pcfg: ParallelConfig, microbatch: int, seq: int, d: ModelDims
) -> tuple[int, int]:
    """(receive-buffer bytes per microbatch, backward transient bytes) of a stage; `d` its ModelDims.

    torch's PipelineStage keeps a [mb, seq, dim] receive buffer per microbatch for activations (all but the
    first stage) and one for their gradients (all but the last), across steps. A backward holds, beyond the
    saved activations: on the last stage three fp32 [mb, seq, vocab (/ tp with loss_parallel)] tensors (the
    gradients of the log-softmax output and of the logits, and the softmax the backward computes; one more
    under TP without loss_parallel, the all-gather of the head's output, whose buffer outlives its use); on
    others two [mb, seq, ffn / tp] gradients inside a block's MLP. The stage input saved in the walk's
    activations is the receive buffer itself, counted twice (an over-estimate of one boundary per held
    microbatch). Activation checkpointing adds what one module's recompute saves (stage_activation_bytes).
    """
    act = 2 if pcfg.mixed_precision == "bf16" else FP32
    seq //= pcfg.cp  # under context parallel every tensor here holds the rank's seq / cp tokens
    boundary = microbatch * seq * d.dim * act
    vocab = d.vocab_size // pcfg.tp if pcfg.loss_parallel and pcfg.tp > 1 else d.vocab_size
    logits = microbatch * seq * vocab * FP32
    gathered = pcfg.tp > 1 and not pcfg.loss_parallel  # the head's output all-gathered to the full vocabulary
    transient = (3 + gathered) * logits if last else 2 * microbatch * seq * (d.ffn_dim // pcfg.tp) * act
    return boundary * ((not first) + (not last)), transient


def rank_memory(pp_rank: int, stages: list[int], costs: list[StageCost], pcfg: ParallelConfig) -> RankMemory:
    """Parameter, gradient and optimizer bytes of one pp rank's stages, and the sizes the step walk moves.

    FSDP keeps fp32 shards (and sharded fp32 gradients); it all-gathers a compute copy in the param dtype
    and accumulates unsharded gradients in grad_accum_dtype (fp32 under fp32) between reductions; when
    each comes and goes is walk_step's business.
    """
    local = sum(c.local for c in costs)
    sizes = {}
    for s, c in zip(stages, costs):
        if uses_fsdp(pcfg):
            p_dtype = 2 if pcfg.mixed_precision == "bf16" else FP32
            g_dtype = 2 if pcfg.mixed_precision == "bf16" and pcfg.grad_accum_dtype == "bf16" else FP32
            sizes[s] = StageBytes(
                c.act_bytes,
                p_dtype * c.tp_local,
                p_dtype * c.unit_tp_local,
                g_dtype * c.tp_local,
                g_dtype * c.unit_tp_local,
            )
        else:
            sizes[s] = StageBytes(c.act_bytes)
    return RankMemory(
        pp_rank,
        stages,
        local,
        param_bytes=local * FP32,
        gathered_bytes=0,
        grad_bytes=local * FP32,
        grad_accum_bytes=0,
        optim_bytes=ADAM_STATES * local * FP32,
        act_bytes_per_microbatch={s: c.act_bytes for s, c in zip(stages, costs)},
        sizes=sizes,
        buffer_bytes=(pcfg.microbatches * sum(c.buffer_bytes for c in costs) if pcfg.pp > 1 else 0)
        + sum(c.held_bytes for c in costs),
        transient_bytes=max(c.transient_bytes for c in costs),
        optim_step_bytes=max(c.local for c in costs) * FP32,
    )


def settle(rank: RankMemory, walk: Walk) -> RankMemory:
    """Fills the rank's coming-and-going parts from its walk's peak moment."""
    rank.act_peak_bytes, rank.gathered_bytes, rank.grad_accum_bytes = walk.act, walk.gathered, walk.grads
    return rank


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
