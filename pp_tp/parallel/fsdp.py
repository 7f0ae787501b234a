"""FSDP2 (`fully_shard`) around each Transformer block and each stage, over dp_shard or HSDP.

The stage module itself is the root FSDP module: torch's PipelineStage checks
``isinstance(submod, FSDPModule)`` to skip gradient sync on every microbatch but the last
(REDUCE_GRAD), so by default gradients are reduce-scattered once per step whatever the microbatch count.

``parallel.fsdp_grad_reduce``: "step" (torch's way: unsharded gradients accumulate until the step's one
reduce-scatter), "microbatch" or an int k (reduce-scatter after every k-th microbatch backward of a
stage, accumulating sharded: ceil(m / k) reduce-scatters per unit per step; see
pp_tp.runtime.grad_reduce). ``parallel.grad_accum_dtype`` "bf16" accumulates the unsharded gradients
(and reduce-scatters) in bf16; the sharded gradient stays fp32.

``parallel.fsdp_reshard_after_forward``:
  default  pp > 1: keep parameters gathered for the whole step (one all-gather per unit per step,
           not one per microbatch); pp = 1: torch's own default (reshard blocks, keep the root)
  always   reshard after every forward (all-gather again in backward and for every microbatch)
  never    keep gathered
  int n    reshard to groups of n ranks (a divisor of dp_shard)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError


def uses_fsdp(pcfg: ParallelConfig) -> bool:
    """FSDP wraps the stages when there is data parallelism or bf16 mixed precision (FSDP's policy casts)."""
    return pcfg.dp > 1 or pcfg.mixed_precision == "bf16"


def grad_factor(pcfg: ParallelConfig) -> int:
    """The factor the loss is multiplied by to undo FSDP's mean over DP ranks (gloo refuses a divide factor)."""
    return pcfg.dp if uses_fsdp(pcfg) else 1


def for_pp_rank(pcfg: ParallelConfig, pp_rank: int) -> ParallelConfig:
    """`pcfg` with per-pp-rank FSDP policy lists (what "auto" resolves to) replaced by this rank's entry."""
    r, g = pcfg.fsdp_reshard_after_forward, pcfg.fsdp_grad_reduce
    r = r[pp_rank] if isinstance(r, list) else r
    g = g[pp_rank] if isinstance(g, list) else g
    if "auto" in (r, g):
        raise ConfigError(
            'parallel.fsdp_reshard_after_forward / fsdp_grad_reduce = "auto" is resolved by the planner before '
            "the process group starts; call pp_tp.planner.resolve_auto(cfg, world_size) first (pp-tp train does)"
        )
    return dataclasses.replace(pcfg, fsdp_reshard_after_forward=r, fsdp_grad_reduce=g)


def grad_reduce_every(pcfg: ParallelConfig) -> int | None:
    """Reduce-scatter after every k-th microbatch backward (k), or None: once per step (torch's way)."""
    g = pcfg.fsdp_grad_reduce
    if not uses_fsdp(pcfg) or g == "step" or (isinstance(g, int) and g >= pcfg.microbatches):
        return None
    return 1 if g == "microbatch" else g


def reshard_after_forward(pcfg: ParallelConfig) -> bool | int | None:
    """The `fully_shard(reshard_after_forward=...)` value for `parallel.fsdp_reshard_after_forward`.

    None (pp = 1, "default") leaves the choice to torch: reshard the blocks, keep the root gathered.
    """
    policy = pcfg.fsdp_reshard_after_forward
    if policy == "default":
        return None if pcfg.pp == 1 else False
    return {"always": True, "never": False}.get(policy, policy)


def keeps_params_gathered(pcfg: ParallelConfig) -> bool:
    """True when parameters stay all-gathered from a step's first forward to its gradient reduction."""
    return uses_fsdp(pcfg) and reshard_after_forward(pcfg) is False


def dp_mesh(mesh: DeviceMesh, pcfg: ParallelConfig) -> DeviceMesh:
    """The 1-D dp_shard mesh (FSDP) or the 2-D (dp_replicate, dp_shard) mesh (HSDP)."""
    return mesh["dp_replicate", "dp_shard"] if pcfg.dp_replicate > 1 else mesh["dp_shard"]


def mixed_precision_policy(pcfg: ParallelConfig) -> MixedPrecisionPolicy:
    """bf16: bf16 compute and all-gather, gradient accumulation and reduction in grad_accum_dtype; fp32: all fp32."""
    if pcfg.mixed_precision == "bf16":
        accum = torch.bfloat16 if pcfg.grad_accum_dtype == "bf16" else torch.float32
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=accum)
    return MixedPrecisionPolicy()


def apply_fsdp(stage: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig) -> bool:
    """`fully_shard` on each block (StageModule.blocks()), then on the stage (root: embed, norm, head)."""
    if not uses_fsdp(pcfg):
        return False
    kwargs = {
        "mesh": dp_mesh(mesh, pcfg),
        "reshard_after_forward": reshard_after_forward(pcfg),
        "mp_policy": mixed_precision_policy(pcfg),
    }
    for block in stage.blocks():
        fully_shard(block, **kwargs)
    fully_shard(stage, **kwargs)
    return True
