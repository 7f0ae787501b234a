"""build_pipeline: the whole flow for one rank, config -> plan -> parallelize -> stages -> schedule."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.config import ParallelConfig, resolve_parallel
from pp_tp.config.fsdp_policy import FsdpPolicy
from pp_tp.hf_checkpoint import open_checked
from pp_tp.materialize import build_local_stages
from pp_tp.parallel.fsdp import grad_factor
from pp_tp.parallel.mesh import build_on, rank_device
from pp_tp.preflight import Preflight, PreflightInputs, check_seq_len, preflight
from pp_tp.preflight.verdict import agreed
from pp_tp.runtime.boundary import BoundaryShapes, InferredShapes, meta_skeleton
from pp_tp.runtime.built import BuildOptions, BuiltStages
from pp_tp.runtime.loss import SumLoss
from pp_tp.runtime.pipeline import Pipeline
from pp_tp.stages.stage_module import StageModule
from pp_tp.stages.tied import TiedWeights, tied_names


def _shapes(
    checked: Preflight, pcfg: ParallelConfig, skeleton: nn.Module | None
) -> Callable[[tuple[int, ...], torch.dtype], BoundaryShapes | InferredShapes]:
    """The boundary tensors for a microbatch of inputs: a language model's from its dims, any other model's inferred
    on `skeleton` (the meta copy of the model)."""
    d = checked.dims
    act_dtype = torch.bfloat16 if pcfg.mixed_precision == "bf16" else getattr(torch, pcfg.dtype)
    vocab_local = d.vocab_size // pcfg.tp if pcfg.loss_parallel else d.vocab_size

    def shapes(microbatch: tuple[int, ...], dtype: torch.dtype) -> BoundaryShapes | InferredShapes:
        if skeleton is not None:
            return InferredShapes(skeleton, checked.layout, checked.plan, microbatch, dtype, act_dtype)
        check_seq_len(microbatch[1], d, key="Pipeline.step: the batch's seq")
        return BoundaryShapes(microbatch[0], microbatch[1], d.dim, vocab_local, act_dtype, d.streams)

    return shapes


def build_pipeline(
    model: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig, *, options: BuildOptions | None = None, **keywords: Any
) -> Pipeline:
    """This rank's share of `model` as pipeline stages with TP and FSDP, and the schedule that runs them.

    `model` is the full model on the meta device (values from `seed`, or `state_dict` keyed by FQN) or holding
    weights (they are used, persistent buffers included). The rest is one `BuildOptions` value (every field and its
    default is documented there): `options=` whole, or its fields as keywords (`seed=`, `state_dict=`, `seq_len=`,
    `checkpoint=`, `source_dir=`, `loss_fn=`, `loss_normalizer=`, `rng_seed=`, `moe=`, `document_mask=`), keywords
    replacing the fields of `options` when both are given. With `loss_fn`, `Pipeline.step(inputs, targets)` takes
    any tensors, boundaries inferred per input shape. Every check and the local build run before any collective; then
    one exchange makes every rank refuse together (the same line) or go on together. With `parallel.dtype = "float64"`
    `model` itself is turned float64 first."""
    opts = BuildOptions.of(options, keywords)
    build_on(mesh)
    if pcfg.dtype == "float64":
        model.to(torch.float64)  # in place, before anything reads it: every floating tensor (integer buffers stay)
        if hasattr(model, "set_experts_implementation"):  # transformers' grouped_mm refuses float64: its eager loop
            model.set_experts_implementation("eager")
    pp_rank, device = mesh.get_local_rank("pp"), rank_device(mesh)
    tied = tied_names(model)  # before the stages are materialized, which unties the shared modules
    skeleton = meta_skeleton(model) if opts.loss_fn is not None else None  # boundary shapes are inferred on it
    casts: Counter = Counter()

    def local_build() -> tuple[ParallelConfig, FsdpPolicy, Preflight, list[StageModule], SumLoss | None]:
        """Every check and this rank's stages, with no communication; ranks agree on the outcome below."""
        inputs = PreflightInputs(mesh.device_type, opts.seq_len, opts.document_mask, opts.loss_fn is not None, opts.moe)
        checked = preflight(model, resolve_parallel(pcfg, dist.get_world_size()), inputs)
        resolved, fsdp = checked.parallel, FsdpPolicy.for_rank(checked.parallel, pp_rank)
        loss = SumLoss(opts.loss_fn, opts.loss_normalizer) if opts.loss_fn is not None else None
        source = open_checked(opts.checkpoint, model) if opts.checkpoint else None
        stages = build_local_stages(
            model, checked.layout, checked.plan, pp_rank, mesh, resolved, fsdp, device, opts.seed, opts.state_dict,
            source, casts,
        )  # fmt: skip
        return resolved, fsdp, checked, stages, loss

    pcfg, fsdp, checked, stages, loss = agreed(local_build)  # one verdict: every rank refuses together, or none does
    plan = checked.plan
    built = BuiltStages(
        stages, plan, mesh, pcfg, fsdp, device, _shapes(checked, pcfg, skeleton), grad_factor(pcfg),
        options=opts,
        loss=loss,
        tp_loss_mesh=mesh["tp"] if pcfg.loss_parallel and pcfg.tp > 1 else None,
        tied=TiedWeights(tied, plan, mesh) if tied else None,
        hf_config=getattr(model, "config", None),
        checkpoint_casts=casts,
    )  # fmt: skip
    return Pipeline(built)
