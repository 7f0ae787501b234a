"""TP styles that compute on local shards inside a sub-block whose input is a Replicate DTensor ("replicate_input").

Inside such a sub-block every input gradient may stay a per-rank partial sum: the sub-block's one input all-reduce
sums them all (backward is linear in the incoming gradient). So these styles hand a Partial gradient back to a
DTensor input instead of reducing it, and run the module's own forward on plain local tensors:

- `PackedColwise`: a Linear packing several parts on its output features (gate and up; q, k and v), split per part
  with `_StridedShard(0, split_factor=parts)`, so each rank keeps the same slice of every part and its local output
  is [part 0 shard | part 1 shard | ...], what the module's own chunking expects (no gather). Parts must be equal:
  torch's placements have no uneven per-part split.
- `ReplicatedPartialGrad`: a module left whole on every rank in front of column-parallel layers (MLA's latent
  projections and norms). Its parameters are Replicate DTensors whose gradients come out Partial (each rank back-
  propagates only its heads' share), summed once per step by `reduce_partial_grads`. Home-made: torch's styles
  either shard a module or all-reduce its input gradient per use.
- `localize_heads`: an attention module slicing a per-part-split q/k/v projection by head counts it reads from its
  own attributes and its config gets this rank's counts (a config copy; the model's config is untouched).
- `local_own_params`: a module's own parameters as DTensors read as local tensors inside its forward; with Replicate,
  what torchtitan's Trainer needs of the modules TP leaves whole (pp_tp.integrations.torchtitan_compat).
- `shard_head_params`: an attention module's own per-head parameters (GPT-OSS's sinks) split by heads like its
  column-parallel q/k/v, read as the local shard inside its forward. Home-made: torch's styles shard submodules'
  weights, not a module's own parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from pp_tp.base._torch import StridedShard, swap_parameters

_PARTIAL = (Partial(),)
# Head counts an attention module may slice its q/k/v projection by (transformers' names), on itself or its config.
HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads", "num_heads")


def localize_heads(module: nn.Module, tp: int) -> None:
    """Divides the head counts `module` and its `config` hold by `tp` (the config as a copy of its own)."""
    config = getattr(module, "config", None)
    if config is not None:
        local = copy.copy(config)
        for name in HEAD_COUNTS:
            if isinstance(getattr(config, name, None), int):
                setattr(local, name, getattr(config, name) // tp)
        module.config = local
    for name in HEAD_COUNTS:
        if isinstance(vars(module).get(name), int):
            setattr(module, name, vars(module)[name] // tp)


def _distribute_own(module: nn.Module, mesh: DeviceMesh, placements: list[Placement], src: int | None) -> None:
    """`module`'s own parameters become DTensors with `placements` (on meta: no communication)."""
    for name, p in list(module.named_parameters(recurse=False)):
        shard = distribute_tensor(p, mesh, placements, src_data_rank=src)
        module.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))


@contextmanager
def _reading_local(module: nn.Module, grad: tuple[Placement, ...] | None = None) -> Iterator[None]:
    """`module`'s own DTensor parameters read as their local shards while inside (gradients with placements `grad`,
    None: the parameter's own)."""
    saved = swap_parameters(
        module, {n: p.to_local(grad_placements=grad) for n, p in module.named_parameters(recurse=False)}
    )
    try:
        yield
    finally:
        swap_parameters(module, saved)


def local_own_params(module: nn.Module, mesh: DeviceMesh, placements: list[Placement], src: int | None = None) -> None:
    """`module`'s own parameters become DTensors with `placements` over `mesh`; its forward reads their local shards
    (the gradients come back with the same placements)."""
    _distribute_own(module, mesh, placements, src)
    forward = module.forward

    def local_forward(*args: Any, **kwargs: Any) -> Any:
        with _reading_local(module):
            return forward(*args, **kwargs)

    module.forward = local_forward


def shard_head_params(module: nn.Module, mesh: DeviceMesh, src_data_rank: int | None = None) -> None:
    """Splits `module`'s own parameters on dim 0 (heads) over `mesh`; its forward reads their local shards (the
    gradients come back as Shard(0) DTensors)."""
    local_own_params(module, mesh, [Shard(0)], src_data_rank)


class _LocalCompute(ParallelStyle):
    """Parameters become DTensors with `placements`; the forward reads them and a DTensor input as local tensors."""

    placements: tuple[Placement, ...]
    param_grad: tuple[Placement, ...] | None  # None: the gradient has the parameter's own placements
    reduce_plain_input: bool  # a plain input's gradient is all-reduced (no replicate_input around the module)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute_own(module, device_mesh, list(self.placements), self.src_data_rank)
        forward = module.forward

        def local_forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(x, DTensor) and self.reduce_plain_input:
                x = DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
            if isinstance(x, DTensor):
                x = x.to_local(grad_placements=_PARTIAL)
            with _reading_local(module, self.param_grad):
                return forward(x, *args, **kwargs)

        module.forward = local_forward
        return module


class PackedColwise(_LocalCompute):
    """Column-parallel Linear split per part (`parts` equal blocks of output features; 1: a plain colwise layer that
    reads a replicated module's output inside the sub-block, its input gradient left partial)."""

    def __init__(self, parts: int):
        super().__init__()
        self.placements = (StridedShard(0, split_factor=parts) if parts > 1 else Shard(0),)
        self.param_grad = None
        self.reduce_plain_input = parts > 1


class ReplicatedPartialGrad(_LocalCompute):
    """A module whole on every TP rank inside a replicate_input sub-block, its gradients left Partial."""

    def __init__(self) -> None:
        super().__init__()
        self.placements = (Replicate(),)
        self.param_grad = _PARTIAL
        self.reduce_plain_input = False
