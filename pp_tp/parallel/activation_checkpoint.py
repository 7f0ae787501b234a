"""Activation checkpointing per block: `full` (the whole block) or `selective` (its attention only).

Home-made wrapper, one reason: torch's checkpoint_wrapper inserts `_checkpoint_wrapped_module` into
parameter names, and names must stay the full model's. Here the module's forward is replaced by a
torch.utils.checkpoint (non-reentrant) call of the original forward: names, hooks and the module
object stay as they are, and FSDP's hooks (applied later) run outside the checkpointed region.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    run.pp_tp_checkpointed = True
    return run


def checkpoint_module(module: nn.Module) -> None:
    """Recomputes `module`'s forward in backward instead of keeping its activations; names are unchanged."""
    if not is_checkpointed(module):
        module.forward = _checkpointed(module.forward)


def is_checkpointed(module: nn.Module) -> bool:
    return getattr(module.forward, "pp_tp_checkpointed", False)


def _attention(block: nn.Module, name: str) -> nn.Module:
    try:
        return block.get_submodule(name)
    except AttributeError:
        raise ConfigError(
            f'parallel.activation_checkpoint = "selective": the block has no attention module '
            f'{name!r}; set the model layout\'s `attention` name or use "full"'
        ) from None


def apply_activation_checkpoint(stage: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig) -> bool:
    """Checkpoints every block (`full`) or every block's attention (`selective`); True when it changed the stage."""
    mode = pcfg.activation_checkpoint
    if mode == "none" or not stage.block_modules():
        return False
    for block in stage.block_modules():
        checkpoint_module(block if mode == "full" else _attention(block, stage.layout.attention))
    return True
