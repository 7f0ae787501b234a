"""What torchtitan 0.3.0's Trainer assumes of a model part, and of torch, that pp_tp's parts and torch 2.13 do not
give by themselves.

One mesh for all of a part's parameters. The Trainer clips with its `clip_grad_norm_`, which stacks per-parameter
norms (DTensor refuses plain tensors beside DTensors, and DTensors of different meshes), and steps its default
fused AdamW, one kernel call per parameter group (plain tensors beside DTensors refused). torchtitan's own TP wraps
every module it leaves whole in `NoParallel` for this reason. pp_tp's TP leaves the norms (and a replicated
embedding) plain, so with tp > 1 their parameters become Replicate DTensors over tp before pp_tp builds the stages,
read as local tensors by the modules' forwards: each TP rank computes them whole as before (no communication, the
same kernels, the same numbers), and FSDP then shards them on the same (dp, tp) mesh as the TP weights.

`torch.distributed.set_timeout`: the Trainer calls it after its first step; torch 2.13 has it under a private name.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from pp_tp.base._torch import set_pg_timeout
from pp_tp.config import ParallelConfig
from pp_tp.layout import ModelLayout, layout_for
from pp_tp.parallel.local_styles import local_own_params
from pp_tp.parallel.tensor_parallel import block_plan, matches_rule
from pp_tp.preflight import resolve_embedding


def install_set_timeout() -> None:
    """`torch.distributed.set_timeout` where torch lacks it (2.13: `distributed_c10d._set_pg_timeout`, same
    signature): torchtitan's Trainer shortens the process groups' timeouts with it after the first step."""
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = set_pg_timeout


def _planned(model: nn.Module, layout: ModelLayout, pcfg: ParallelConfig) -> set[str]:
    """FQNs of the modules pp_tp's TP plan gives a style (stage_plan's rules, on the full model)."""
    planned = {layout.head} | ({layout.embed} if pcfg.embedding != "replicate" else set())
    for key, block in model.get_submodule(layout.blocks).named_children():
        rules = block_plan(block, layout)
        names = (n for n, _ in block.named_modules() if n)
        planned.update(f"{layout.blocks}.{key}.{n}" for n in names if any(matches_rule(r, n) for r in rules))
    return planned


def whole_modules(model: nn.Module, pcfg: ParallelConfig) -> list[str]:
    """FQNs of the modules holding plain parameters of their own that pp_tp's TP leaves whole on every TP rank."""
    layout = layout_for(model)
    planned = _planned(model, layout, resolve_embedding(pcfg, layout.dims(model)))
    return [
        name
        for name, module in model.named_modules()
        if name not in planned and any(not isinstance(p, DTensor) for p in module.parameters(recurse=False))
    ]


def one_mesh_per_part(model: nn.Module, pcfg: ParallelConfig, mesh: DeviceMesh) -> None:
    """Before the build, with tp > 1: every module TP would leave whole gets Replicate parameters over tp."""
    if pcfg.tp == 1 or layout_for(model).tp_refusal:  # the build refuses TP of such a model itself
        return
    for fqn in whole_modules(model, pcfg):  # read locally, each TP rank gets its full (Replicate) gradient
        local_own_params(model.get_submodule(fqn), mesh["tp"], [Replicate()])
