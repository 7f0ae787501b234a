"""Placeholder pass: its issue fills it in."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.config import ParallelConfig


def apply_activation_checkpoint(stage: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig) -> bool:
    """Returns True when it changed the stage."""
    return False
