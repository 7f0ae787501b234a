"""The one function that fixes the order of parallelisms on a stage: TP -> float8 -> AC -> compile -> FSDP.

The order matters and a wrong one fails silently: float8 must convert the Linear layers TP already
sharded, activation checkpointing must wrap the converted blocks, compile must see the checkpointed
blocks, and FSDP must shard what is finally there.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.config import ParallelConfig
from pp_tp.config.fsdp_policy import FsdpPolicy
from pp_tp.parallel.activation_checkpoint import apply_activation_checkpoint
from pp_tp.parallel.compile import apply_compile
from pp_tp.parallel.float8 import apply_float8
from pp_tp.parallel.fsdp import apply_fsdp
from pp_tp.parallel.tensor_parallel import apply_tp

PASSES = (
    ("tp", apply_tp),
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
