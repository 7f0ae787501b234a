"""`pp-tp train`: the TOML-driven loop every rank runs: data -> Pipeline.step -> clip -> AdamW -> LR schedule.

`python -m pp_tp.cli.train --config F [section.key=value ...]` is the per-rank entry torchrun starts (one node
or many); `pp-tp train --nproc N` spawns N local ranks through torchrun itself. With `[checkpoint] enable`,
a run resumes from the newest checkpoint in its folder, so `torchrun --max-restarts` continues a job
after a rank dies, with the same losses as an uninterrupted run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import pp_tp
from pp_tp.config import JobConfig, TrainingConfig
from pp_tp.layout import layout_for
from pp_tp.mesh import init_distributed
from pp_tp.models.factory import build_model
from pp_tp.parallel.grads import clip_grad_norm_
from pp_tp.planner import resolve_auto
from pp_tp.split import cost
from pp_tp.train import run_report
from pp_tp.train.checkpoint import Checkpointer, latest_checkpoint
from pp_tp.train.data import ShardedBatches, dp_coords, make_source
from pp_tp.train.liveness import PeerWatch
from pp_tp.train.metrics import MetricsLogger, peak_flops
from pp_tp.train.nonfinite import NonFiniteError, NonFiniteGuard, describe, is_finite
from pp_tp.train.validation import Validator


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier for the update after `step` completed ones: linear warmup, then cosine down to `min_ratio`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def _param_groups(part: nn.Module) -> list[dict]:
    """A part's parameters as one group per kind, DTensor or plain: torch's foreach kernels refuse a mix (TP
    without FSDP leaves the norms plain), and AdamW runs its foreach kernels once per group."""
    kinds: dict[bool, list[nn.Parameter]] = {}
    for p in part.parameters():
        kinds.setdefault(isinstance(p, DTensor), []).append(p)
    return [{"params": params} for params in kinds.values()]


def build_optimizers(
    parts: list[nn.Module], t: TrainingConfig
) -> tuple[list[torch.optim.Optimizer], list[torch.optim.lr_scheduler.LambdaLR]]:
    """One AdamW and LR schedule per model part: torch's optimizer state-dict helpers map a part's own
    parameters to FQNs, so per-part optimizers give checkpoints keyed by the full model's names.

    foreach on every device, CPU included: one kernel call per group instead of ~10 per tensor, which is
    what a DTensor's per-call dispatch makes expensive (bench/trainer_loop.py)."""
    optimizers = [
        torch.optim.AdamW(
            _param_groups(part), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay, foreach=True
        )
        for part in parts
    ]
    schedulers = [
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, t.warmup_steps, t.steps, t.min_lr_ratio))
        for opt in optimizers
    ]
    return optimizers, schedulers


def _one_step(pipe, mesh, loader, optimizers, schedulers, guard: NonFiniteGuard, t: TrainingConfig, step: int):
    """Forward/backward, clip, and the optimizer step unless the loss or grad norm is non-finite (then stop,
    or skip with training.skip_nonfinite). Returns (loss, grad_norm, lr, stepped)."""
    ids, labels = loader.next()
    for opt in optimizers:
        opt.zero_grad()
    guard.begin_step()
    loss = float(pipe.step(ids, labels))
    grad_norm = float(clip_grad_norm_(pipe.model_parts, t.max_norm, mesh))
    lr = schedulers[0].get_last_lr()[0]
    if not is_finite(loss, grad_norm):  # loss and norm are global: every rank takes this branch together
        msg = describe(step, loss, grad_norm, guard.where())
        if not t.skip_nonfinite:
            raise NonFiniteError(f"{msg}; set training.skip_nonfinite = true to skip such steps")
        for opt in optimizers:
            opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"skipped {msg}", flush=True)
        return loss, grad_norm, lr, False
    for opt, sched in zip(optimizers, schedulers):
        opt.step()
        sched.step()
    return loss, grad_norm, lr, True


def _metrics(cfg: JobConfig, dims, mesh) -> MetricsLogger:
    t = cfg.training
    flops = dims.n_layers * cost.block_flops(dims, t.seq_len) + cost.head_flops(dims) + cost.embed_flops(dims)
    device_peak = (
        peak_flops(torch.cuda.get_device_name())
        if mesh.device_type == "cuda" and cfg.parallel.mixed_precision == "bf16"
        else None
    )
    return MetricsLogger(
        t.metrics_file, t.log_every, dist.get_rank() == 0, flops, dist.get_world_size(), device_peak, t.steps
    )


def _resume(ckpt: Checkpointer, resume: str | None, cfg: JobConfig) -> int:
    if not resume:
        return 0
    step = ckpt.load(resume)
    if dist.get_rank() == 0:
        print(f"resumed from {resume} at step {step}", flush=True)
        if step >= cfg.training.steps:
            print(
                f"nothing to train: the run is complete (training.steps = {cfg.training.steps}); raise "
                f"training.steps to continue or delete {cfg.checkpoint.folder} to start over",
                flush=True,
            )
    return step


def train(cfg: JobConfig, before_step: Callable[[int], None] | None = None) -> list[dict]:
    """Runs (or resumes) the job on this rank; returns one metrics row per step run here (global numbers).

    `before_step(step)` runs at the start of every step (fault injection, profiling)."""
    t = cfg.training
    source = make_source(cfg)
    validator = Validator(cfg)  # held-out text checked here, before any collective
    cfg, auto_line = resolve_auto(cfg)  # "auto" FSDP policies: the planner picks them before the process group
    plan = run_report.dry_run(cfg)
    init_distributed(t.comm_timeout_s)
    torch.manual_seed(t.seed)
    mesh = pp_tp.build_mesh(cfg.parallel)
    model = build_model(cfg.model, "meta")
    dims = layout_for(model).dims(model)
    resume = latest_checkpoint(cfg.checkpoint.folder) if cfg.checkpoint.enable else None
    hf_dir, weights_line = run_report.initial_weights(cfg, resume)  # a DCP checkpoint wins over the HF load
    pipe = pp_tp.build_pipeline(
        model, mesh, cfg.parallel, seed=cfg.model.seed, seq_len=t.seq_len, checkpoint=hf_dir,
        source_dir=cfg.model.hf_path or None,  # save_pretrained keeps its generation_config.json
    )  # fmt: skip
    loader = ShardedBatches(source, t.batch_size, *dp_coords(mesh), seed=t.seed)
    optimizers, schedulers = build_optimizers(pipe.model_parts, t)
    ckpt = Checkpointer(cfg.checkpoint, pipe.model_parts, optimizers, schedulers, loader)
    step = _resume(ckpt, resume, cfg)
    metrics = _metrics(cfg, dims, mesh)
    text, layout_row = run_report.layout(cfg, mesh, pipe, plan)
    if dist.get_rank() == 0:
        print("\n".join(x for x in (auto_line, weights_line, text) if x), flush=True)
        metrics.record({**layout_row, "weights": weights_line})
    guard = NonFiniteGuard(pipe.model_parts, pipe.pcfg.num_stages, pipe.device)
    watch = PeerWatch()
    rows, skipped = [], 0
    try:
        while step < t.steps:
            step += 1
            if before_step is not None:
                before_step(step)
            with watch.naming_dead_peers(step):
                start = time.perf_counter()
                loss, grad_norm, lr, stepped = _one_step(pipe, mesh, loader, optimizers, schedulers, guard, t, step)
                elapsed = time.perf_counter() - start
                skipped += not stepped
                extra = {"skipped_steps": skipped}
                if validator.due(step, step == t.steps):
                    extra["val_loss"] = validator.run(pipe, mesh)
                tokens = t.batch_size * t.seq_len
                rows.append(metrics.log(step, step == t.steps, loss, grad_norm, lr, tokens, elapsed, extra))
                ckpt.maybe_save(step, last=step == t.steps)
    finally:
        watch.stop()
    return rows
