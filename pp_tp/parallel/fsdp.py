"""FSDP2 (`fully_shard`) around each Transformer block and each stage, over dp_shard or HSDP.

The stage module itself is the root FSDP module: torch's PipelineStage checks
``isinstance(submod, FSDPModule)`` to skip gradient sync on every microbatch but the last
(REDUCE_GRAD), so by default gradients are reduce-scattered once per step whatever the microbatch count.

How a rank reshards and reduces is its `FsdpPolicy` (pp_tp.config.fsdp_policy, with the policy keys' values);
reducing every k microbatches is pp_tp.runtime.grad_reduce. ``parallel.grad_accum_dtype`` "bf16" accumulates
the unsharded gradients (and reduce-scatters) in bf16; the sharded gradient stays fp32.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from pp_tp.base._torch import StridedShard
from pp_tp.config import ParallelConfig
from pp_tp.config.fsdp_policy import FsdpPolicy, uses_fsdp
from pp_tp.layout import ModelLayout
from pp_tp.parallel.experts import experts_modules


def grad_factor(pcfg: ParallelConfig) -> int:
    """The factor the loss is multiplied by to undo FSDP's mean over DP (and cp) ranks (gloo refuses a divide
    factor): cp ranks hold different tokens of the same rows, so their gradients are summed, not averaged."""
    return pcfg.dp * pcfg.cp if uses_fsdp(pcfg) else 1


def dp_mesh(mesh: DeviceMesh, pcfg: ParallelConfig) -> DeviceMesh:
    """The 1-D dp_shard mesh (FSDP; dp_shard x cp flattened under context parallel: cp ranks hold the same
    parameters) or the 2-D (dp_replicate, that) mesh (HSDP)."""
    shard = "dp_shard_cp" if pcfg.cp > 1 else "dp_shard"
    return mesh["dp_replicate", shard] if pcfg.dp_replicate > 1 else mesh[shard]


def expert_dp_mesh(mesh: DeviceMesh, pcfg: ParallelConfig) -> DeviceMesh:
    """The data-parallel ranks holding the same experts under expert parallel (what EP leaves of DP)."""
    return mesh["dp_replicate", "dp_shard_mod_ep"] if pcfg.dp_replicate > 1 else mesh["dp_shard_mod_ep"]


def mixed_precision_policy(pcfg: ParallelConfig) -> MixedPrecisionPolicy:
    """bf16: bf16 compute and all-gather, gradient accumulation and reduction in grad_accum_dtype; fp32: all fp32."""
    if pcfg.mixed_precision == "bf16":
        accum = torch.bfloat16 if pcfg.grad_accum_dtype == "bf16" else torch.float32
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=accum)
    return MixedPrecisionPolicy()


def apply_fsdp(stage: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig, policy: FsdpPolicy) -> bool:
    """`fully_shard` on each block (StageModule.block_modules()), then on the stage (root: embed, norm, head), as this
    pp rank's `policy` says."""
    if not policy.shards:
        return False
    kwargs = {
        "mesh": dp_mesh(mesh, pcfg),
        "reshard_after_forward": policy.reshard_after_forward,
        "mp_policy": mixed_precision_policy(pcfg),
        "shard_placement_fn": _shard_placement,
    }
    for block in stage.block_modules():
        if pcfg.ep > 1:
            _shard_moe(block, stage.layout, mesh, pcfg, kwargs)
        fully_shard(block, **kwargs)
    fully_shard(stage, **kwargs)
    return True


def _shard_placement(param: nn.Parameter) -> Shard | None:
    """FSDP shards dim 1 of a Linear weight TP splits per part on dim 0 (`_StridedShard`, local_styles.py): sharding
    the same dim twice gave wrong values (measured: Phi3 at tp2 x dp_shard2, gradients 170 % off); others dim 0."""
    placements = param.placements if isinstance(param, DTensor) else ()
    if param.dim() == 2 and any(isinstance(p, StridedShard) and p.dim == 0 for p in placements):
        return Shard(1)
    return None


def _shard_moe(block: nn.Module, layout: ModelLayout, mesh: DeviceMesh, pcfg: ParallelConfig, kwargs: dict) -> None:
    """Under expert parallel, each experts module is an FSDP unit over the ranks holding the same experts, and
    the MoE module around it another, so attention and MoE are separate units. FSDP averages the experts'
    gradients over dp / ep ranks instead of dp: the dispatch scales them by 1 / ep (ExpertDispatch.grad_scale)."""
    found = experts_modules(block, layout)
    for _, experts in found:  # every experts module first: a parent may hold several (JetMoE's input/output)
        fully_shard(experts, **{**kwargs, "mesh": expert_dp_mesh(mesh, pcfg)})
    for parent in dict.fromkeys(name.rpartition(".")[0] for name, _ in found if "." in name):
        fully_shard(block.get_submodule(parent), **kwargs)
