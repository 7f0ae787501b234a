"""Declared tensor parallelism (CREDIT's convention): a block names its column- and row-parallel layers.

A block class may set ``_tp_col`` and ``_tp_row``: dotted paths into the block (Sequential indices included), a
string or equal-length lists, the i-th column layer paired with the i-th row layer. The column layer splits its
output features (nn.Linear) or channels (nn.Conv2d) and hands on its shard with no collective; the row layer
splits its input the same way and all-reduces its output once, adding its bias once. Per pair and microbatch that
is one all-reduce forward (the row output) and one backward (the column input's gradient). Only nn.Linear and
plain 1x1 nn.Conv2d are accepted: a channel-split conv with a spatial kernel, stride, padding, dilation or groups
would need a halo or a regrouping that a split layer would silently drop.
"""

from __future__ import annotations

from itertools import takewhile
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from pp_tp.errors import ConfigError


class ConvChannelParallel(ParallelStyle):
    """A plain 1x1 nn.Conv2d split on channels: output channels (weight dim 0, bias too) for `column`, input
    channels (weight dim 1, bias whole) otherwise. Its own style because torch's ColwiseParallel/RowwiseParallel
    take only Linear/Embedding and DTensor's convolution rule shards only the batch dim: the conv runs on the
    local shards, and the parameters stay DTensors (FSDP, checkpoints and `.full_tensor()` see whole values)."""

    def __init__(self, column: bool):
        super().__init__()
        self.column = column

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        weight_dim = 0 if self.column else 1

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                if pname == "weight":
                    placement = Shard(weight_dim)
                else:  # the bias: sharded with the column layer's output, whole (added once) on the row layer
                    placement = Shard(0) if self.column else Replicate()
                dist = distribute_tensor(p, mesh, [placement], src_data_rank=self.src_data_rank)
                mod.register_parameter(pname, nn.Parameter(dist, p.requires_grad))

        distribute_module(module, device_mesh, partition)
        column = self.column

        def forward(x: torch.Tensor) -> torch.Tensor:
            w = module.weight.to_local()  # differentiable: its gradient comes back as a DTensor of w's sharding
            b = module.bias.to_local() if module.bias is not None else None
            if column:
                # Identity forward; the input gradient, partial over this rank's channels, is all-reduced in backward
                # where x became a Replicate DTensor: here, or once for a whole "replicate_input" sub-block.
                if not isinstance(x, DTensor):
                    x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                return F.conv2d(x.to_local(grad_placements=[Partial()]), w, b)
            y = DTensor.from_local(F.conv2d(x, w), device_mesh, [Partial()], run_check=False)
            y = y.redistribute(device_mesh, [Replicate()]).to_local()  # the one forward all-reduce
            return y if b is None else y + b.view(1, -1, 1, 1)

        module.forward = forward
        return module


def _plain_1x1(conv: nn.Conv2d) -> bool:
    return (
        tuple(conv.kernel_size) == (1, 1)
        and tuple(conv.stride) == (1, 1)
        and conv.padding in ((0, 0), "valid")
        and tuple(conv.dilation) == (1, 1)
        and conv.groups == 1
    )


def _paths(block: nn.Module, attr: str, where: str) -> list[str]:
    value: Any = getattr(block, attr, None)
    if value is None:
        return []
    paths = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(p, str) for p in paths):
        raise ConfigError(f"{where}: {attr} = {value!r} must be a dotted path or a list of them")
    return paths


def _style(block: nn.Module, path: str, attr: str, where: str) -> str:
    """The style name for one declared layer, or a one-line refusal naming the block and the path."""
    try:
        layer = block.get_submodule(path)
    except AttributeError:
        raise ConfigError(f"{where}: {attr} path {path!r} names no submodule; fix the path") from None
    kind = "col" if attr == "_tp_col" else "row"
    if type(layer) is nn.Linear:
        return "colwise" if kind == "col" else "rowwise"
    if type(layer) is nn.Conv2d and _plain_1x1(layer):
        return f"conv_{kind}wise"
    what = (
        f"a Conv2d with kernel {tuple(layer.kernel_size)}, stride {tuple(layer.stride)}, padding {layer.padding}, "
        f"dilation {tuple(layer.dilation)}, groups {layer.groups}"
        if isinstance(layer, nn.Conv2d)
        else f"a {type(layer).__name__}"
    )
    raise ConfigError(
        f"{where}: {attr} path {path!r} is {what}; only nn.Linear and plain 1x1 nn.Conv2d (stride 1, padding 0, "
        "dilation 1, groups 1) can be split, so declare another layer or set parallel.tp = 1"
    )


def declared_plan(block: nn.Module, where: str) -> dict[str, str]:
    """The plan rules `_tp_col` / `_tp_row` declare on `block` (empty if it declares none), checked in one line each:
    paths exist, pairs match up, layers are Linear or plain 1x1 Conv2d, and nothing else holding parameters sits
    beside a pair inside the module that holds both (it would see a channel shard)."""
    cols, rows = _paths(block, "_tp_col", where), _paths(block, "_tp_row", where)
    if len(cols) != len(rows):
        raise ConfigError(
            f"{where}: _tp_col {cols} and _tp_row {rows} must pair up one to one (the i-th column layer feeds the "
            "i-th row layer); give both the same number of paths"
        )
    plan = {p: _style(block, p, "_tp_col", where) for p in cols}
    plan.update({p: _style(block, p, "_tp_row", where) for p in rows})
    for col, row in zip(cols, rows):
        common = takewhile(lambda ab: ab[0] == ab[1], zip(col.split(".")[:-1], row.split(".")[:-1]))
        parent = ".".join(a for a, _ in common)
        if not parent:
            continue  # the block itself: its other layers see whole activations
        inside = [f"{parent}.{n}" for n, _ in block.get_submodule(parent).named_parameters()]
        stray = [n for n in inside if not any(n.startswith(p + ".") for p in plan)]
        if stray:
            raise ConfigError(
                f"{where}: parameter {stray[0]!r} sits in {parent!r} beside the declared pair ({col!r}, {row!r}) and "
                "would see a channel shard; move it out of that module or set parallel.tp = 1"
            )
    return plan
