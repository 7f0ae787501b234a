"""`pp-tp train`: the TOML-driven loop every rank runs: data -> Pipeline.step -> clip -> AdamW -> LR schedule.

`Trainer(cfg)` sets the job up in its one working order and keeps every piece as an attribute; `Trainer.run`
trains; `train(cfg)` is both.

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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import pp_tp
from pp_tp.config import JobConfig, TrainingConfig
from pp_tp.layout import layout_for
from pp_tp.models.factory import build_model
from pp_tp.parallel.experts import experts_modules
from pp_tp.parallel.grads import clip_grad_norm_
from pp_tp.parallel.mesh import dp_rank, dp_size, init_distributed
from pp_tp.planner import resolve_auto
from pp_tp.train import run_report
from pp_tp.train.checkpoint import Checkpointer, resume_checkpoint
from pp_tp.train.liveness import PeerWatch
from pp_tp.train.metrics import MetricsLogger, flops_per_token, moe_imbalance, peak_flops
from pp_tp.train.nonfinite import NonFiniteError, NonFiniteGuard, describe, is_finite
from pp_tp.train.prefetch import Prefetcher
from pp_tp.train.sources import make_source
from pp_tp.train.tensorboard import check_tensorboard
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


def _metrics(cfg: JobConfig, flops: float, mesh: DeviceMesh) -> MetricsLogger:
    t = cfg.training
    device_peak = (
        peak_flops(torch.cuda.get_device_name())
        if mesh.device_type == "cuda" and cfg.parallel.mixed_precision == "bf16"
        else None
    )
    return MetricsLogger(
        t.metrics_file, t.log_every, dist.get_rank() == 0, flops, dist.get_world_size(), device_peak, t.steps,
        t.tensorboard_dir,
    )  # fmt: skip


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


class Trainer:
    """One rank's training job. The constructor does the setup in the one order that works and keeps every piece
    as an attribute (`pipe`, `mesh`, `loader`, `optimizers`, `schedulers`, `checkpointer`, `step`, ...); `run`
    trains from `step` to training.steps.

    The order: the data source and held-out text are checked first (one-line errors, nothing started); the "auto"
    FSDP policies and the planner's dry run each need a fake process group of their own, so both come before
    `init_distributed`; then mesh, model (meta), pipeline, loader, optimizers, checkpointer, and the resume from the
    newest checkpoint (step, weights, optimizer, data position, RNG), which needs all of them. `mesh`: one of
    cfg.parallel's shape the caller already holds (tests running many jobs reuse theirs); None builds it."""

    def __init__(self, cfg: JobConfig, mesh: DeviceMesh | None = None):
        self.source = make_source(cfg)
        check_tensorboard(cfg.training.tensorboard_dir)
        self.validator = Validator(cfg)  # held-out text checked here, before any collective
        self.cfg, self.auto_line = resolve_auto(cfg)  # "auto" FSDP policies, before the process group
        self.plan = run_report.dry_run(self.cfg)
        t = self.cfg.training
        init_distributed(t.comm_timeout_s)
        torch.manual_seed(t.seed)
        self.mesh = pp_tp.build_mesh(self.cfg.parallel) if mesh is None else mesh
        model = build_model(self.cfg.model, "meta")
        layout = layout_for(model)
        flops = flops_per_token(model, layout, t.seq_len)  # on the meta model, before build_pipeline prunes it
        self.has_experts = any(experts_modules(b, layout) for b in model.get_submodule(layout.blocks).children())
        resume, self.fallback_line = resume_checkpoint(self.cfg.checkpoint)  # verified first
        hf_dir, self.weights_line = run_report.initial_weights(self.cfg, resume)  # a DCP checkpoint wins over HF
        self.pipe = pp_tp.build_pipeline(
            model, self.mesh, self.cfg.parallel, seed=self.cfg.model.seed, seq_len=t.seq_len, checkpoint=hf_dir,
            source_dir=self.cfg.model.hf_path or None,  # save_pretrained keeps its generation_config.json
            loss_fn=t.loss or None,  # a model that is not an LM: its own loss, e.g. "mse"
            rng_seed=t.seed,  # dropout streams per (stage, dp rank), per TP rank in sharded regions
            moe=self.cfg.moe,  # MoE load balancing: auxiliary loss, expert-bias update
            document_mask=self.cfg.data.document_mask,  # packed documents: refused at the build where not maskable
            grpo_clip=t.grpo_clip, grpo_kl_coef=t.grpo_kl_coef,  # step(..., loss_fn="grpo") for an RL loop
        )  # fmt: skip
        self.loader = Prefetcher(self.source.loader(dp_rank(self.mesh), dp_size(self.mesh)), self.cfg.data.prefetch)
        self.optimizers, self.schedulers = build_optimizers(self.pipe.model_parts, t)
        parts = self.pipe.model_parts
        self.checkpointer = Checkpointer(
            self.cfg.checkpoint, parts, self.optimizers, self.schedulers, self.loader, self.pipe.rng_streams,
            t.comm_timeout_s,  # bounds the background saves' collectives (checkpoint.async)
        )  # fmt: skip
        self.step = _resume(self.checkpointer, resume, self.cfg)
        self.metrics = _metrics(self.cfg, flops, self.mesh)
        self.guard = NonFiniteGuard(parts, self.pipe.pcfg.num_stages, self.pipe.device)
        self.skipped = 0

    def run(self, before_step: Callable[[int], None] | None = None) -> list[dict]:
        """Trains to training.steps; one metrics row per step run here (global numbers).

        `before_step(step)` runs at the start of every step (fault injection, profiling)."""
        text, layout_row = run_report.layout(self.cfg, self.mesh, self.pipe, self.plan)
        if dist.get_rank() == 0:
            print("\n".join(x for x in (self.auto_line, self.fallback_line, self.weights_line, text) if x), flush=True)
            self.metrics.record({**layout_row, "weights": self.weights_line})
        watch = PeerWatch()
        rows = []
        try:
            while self.step < self.cfg.training.steps:
                self.step += 1
                if before_step is not None:
                    before_step(self.step)
                with watch.naming_dead_peers(self.step):
                    rows.append(self._train_step())
        finally:
            watch.stop()
            self.loader.stop()
            self.checkpointer.close()  # after an error: a background save in flight ends before the run does
        return rows

    def _train_step(self) -> dict:
        """One step and what follows it: validation when due, the metrics row, a checkpoint when due."""
        t, step = self.cfg.training, self.step
        last = step == t.steps
        start = time.perf_counter()
        loss, grad_norm, lr, stepped = self._optimizer_step()
        elapsed = time.perf_counter() - start
        self.skipped += not stepped
        extra = {"skipped_steps": self.skipped, "data_s": self.loader.wait_s}
        if self.has_experts:
            extra.update(moe_imbalance(self.pipe.moe_stats.get("tokens_per_expert", {}), self.mesh))
            extra["aux_loss"] = self.pipe.moe_stats.get("aux_loss", 0.0)
        if self.validator.due(step, last):
            extra["val_loss"] = self.validator.run(self.pipe, self.mesh)
        row = self.metrics.log(step, last, loss, grad_norm, lr, t.batch_size * t.seq_len, elapsed, extra)
        self.checkpointer.maybe_save(step, last=last)
        return row

    def _optimizer_step(self) -> tuple[float, float, float, bool]:
        """Forward/backward, clip, and the optimizer step unless the loss or grad norm is non-finite (then stop,
        or skip with training.skip_nonfinite). Returns (loss, grad_norm, lr, stepped)."""
        t = self.cfg.training
        batch = self.loader.next()
        for opt in self.optimizers:
            opt.zero_grad()
        self.guard.begin_step()
        loss = float(self.pipe.step(*batch))
        grad_norm = float(clip_grad_norm_(self.pipe.model_parts, t.max_norm, self.mesh))
        lr = self.schedulers[0].get_last_lr()[0]
        if not is_finite(loss, grad_norm):  # loss and norm are global: every rank takes this branch together
            msg = describe(self.step, loss, grad_norm, self.guard.where())
            if not t.skip_nonfinite:
                raise NonFiniteError(f"{msg}; set training.skip_nonfinite = true to skip such steps")
            for opt in self.optimizers:
                opt.zero_grad()
            if dist.get_rank() == 0:
                print(f"skipped {msg}", flush=True)
            return loss, grad_norm, lr, False
        for opt, sched in zip(self.optimizers, self.schedulers):
            opt.step()
            sched.step()
        self.pipe.update_expert_bias()  # [moe] bias_update_rate: after the step, from its tokens per expert
        return loss, grad_norm, lr, True


def train(cfg: JobConfig, before_step: Callable[[int], None] | None = None) -> list[dict]:
    """Runs (or resumes) the job on this rank (`pp-tp train`'s per-rank work); one metrics row per step run here.

    `before_step(step)` runs at the start of every step (fault injection, profiling)."""
    return Trainer(cfg).run(before_step)
