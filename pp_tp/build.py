"""build_pipeline: the whole flow for one rank, config -> plan -> parallelize -> stages -> schedule."""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.config import ParallelConfig, check_model_shape, resolve_parallel
from pp_tp.errors import ConfigError
from pp_tp.parallel.float8 import check_float8
from pp_tp.parallel.fsdp import grad_factor
from pp_tp.parallel.tensor_parallel import check_tp_plan
from pp_tp.schedules.pipeline import BoundaryShapes, Pipeline
from pp_tp.stages.build import build_local_stages
from pp_tp.stages.layouts import layout_for
from pp_tp.stages.plan import plan_stages


def build_pipeline(model: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig, *, seed: int = 0,
                   state_dict: Mapping[str, torch.Tensor] | None = None, seq_len: int | None = None) -> Pipeline:
    """This rank's share of `model` as pipeline stages with TP and FSDP, and the schedule that runs them.

    `model` is the full model on the meta device (values from `seed`, or `state_dict` keyed by FQN) or
    holding weights (they are used). Every check runs before any collective.
    """
    pcfg = resolve_parallel(pcfg, dist.get_world_size())
    layout = layout_for(model)
    d = layout.dims(model)
    check_model_shape(pcfg, n_layers=d.n_layers, n_heads=d.n_heads, n_kv_heads=d.n_kv_heads, ffn_dim=d.ffn_dim,
                      vocab_size=d.vocab_size, dim=d.dim)
    if d.tied and (pcfg.pp > 1 or pcfg.tp > 1 or pcfg.dp > 1):
        raise ConfigError("model.tie_embeddings: tied input/output embeddings are only supported on one rank; "
                          "untie them (model.tie_embeddings = false) for pp/tp/dp > 1")
    check_tp_plan(model, layout, pcfg)
    check_float8(pcfg, mesh.device_type)
    plan = plan_stages(model, layout, pcfg, seq_len)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    pp_rank = mesh.get_local_rank("pp")
    stages = build_local_stages(model, layout, plan, pp_rank, mesh, pcfg, device, seed, state_dict)
    act_dtype = torch.bfloat16 if pcfg.mixed_precision == "bf16" else torch.float32
    vocab_local = d.vocab_size // pcfg.tp if pcfg.loss_parallel else d.vocab_size

    def shapes(microbatch: int, seq: int) -> BoundaryShapes:
        if seq > d.max_seq_len:
            raise ConfigError(f"Pipeline.step: seq {seq} exceeds the model's max_seq_len {d.max_seq_len}")
        return BoundaryShapes(microbatch, seq, d.dim, vocab_local, act_dtype)

    tp_loss_mesh = mesh["tp"] if pcfg.loss_parallel and pcfg.tp > 1 else None
    return Pipeline(stages, plan, mesh, pcfg, device, shapes, grad_factor(pcfg), tp_loss_mesh)
