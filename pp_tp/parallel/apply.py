"""The one function that fixes the order of parallelisms on a stage: TP -> EP -> CP -> float8 -> AC -> compile -> FSDP.

The order matters and a wrong one fails silently: the experts pass shards what TP leaves whole, float8 must
convert the Linear layers TP already sharded (experts are 3-D weights, which float8 leaves as they are),
activation checkpointing must wrap the converted blocks, compile must see the checkpointed blocks, and FSDP
must shard what is finally there (experts over the ranks EP leaves). Context parallel marks the attention modules
before activation checkpointing wraps the blocks (it finds them by the layout's names).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.config import ParallelConfig
from pp_tp.config.fsdp_policy import FsdpPolicy
from pp_tp.parallel.activation_checkpoint import apply_activation_checkpoint
from pp_tp.parallel.compile import apply_compile
from pp_tp.parallel.context_parallel import apply_context_parallel
from pp_tp.parallel.experts import apply_experts
from pp_tp.parallel.float8 import apply_float8
from pp_tp.parallel.fsdp import apply_fsdp
from pp_tp.parallel.tensor_parallel import apply_tp

PASSES = (
    ("tp", apply_tp),
    ("experts", apply_experts),  # expert parallel and TP of experts
    ("context_parallel", apply_context_parallel),  # K/V all-gathered over cp in every attention
    ("float8", apply_float8),
    ("activation_checkpoint", apply_activation_checkpoint),
    ("compile", apply_compile),
    ("fsdp", apply_fsdp),  # the one pass that also takes the pp rank's FsdpPolicy
)


def parallelize_stage(stage: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig, fsdp: FsdpPolicy) -> list[str]:
    """Applies every enabled pass in PASSES order, FSDP with this pp rank's policy `fsdp`; returns the names of
    the passes that changed the stage."""
    extra = {"fsdp": (fsdp,)}
    return [name for name, fn in PASSES if fn(stage, mesh, pcfg, *extra.get(name, ()))]
