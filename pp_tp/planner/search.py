"""`pp-tp plan --search`: enumerate layouts of a job at a world size, keep those whose predicted per-rank
peak fits, rank them by a simulated step time.

Cost model (stated, not measured): a stage's compute is its analytic FLOPs (pp_tp.stages.cost: 6 x matmul
params + attention per token, fwd+bwd; full AC adds one forward, 1/3 of it) over tp at the device's peak
FLOP/s; TP adds 4 ring all-reduces of [mb, seq, dim] bf16 per block per microbatch at NVLink bandwidth;
FSDP moves the step walk's all-gather and reduce-scatter bytes ((n-1)/n of them) at NVLink bandwidth when
tp x dp_shard fits a node of 8, else InfiniBand, overlapped with compute (only what exceeds compute
shows). Step time = max over pp ranks of (compute + TP) x (1 + simulated bubble) + exposed FSDP time.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from pp_tp.config import JobConfig
from pp_tp.errors import ConfigError
from pp_tp.planner.auto import GIB, comm_bytes
from pp_tp.planner.dry_run import JobPlan, plan_job

DEVICES = {"H100": (989e12, 450e9, 50e9), "H200": (989e12, 450e9, 50e9)}  # bf16 dense FLOP/s, NVLink, IB B/s
NODE = 8
PARALLEL_KEYS = ("pp", "tp", "dp_replicate", "dp_shard", "schedule", "stages_per_rank", "microbatches")
POLICY_KEYS = ("fsdp_reshard_after_forward", "fsdp_grad_reduce", "activation_checkpoint")


@dataclass(frozen=True)
class Device:
    peak_flops: float
    nvlink_bw: float
    ib_bw: float


@dataclass
class Candidate:
    parallel: dict
    peak_gib: float
    step_time_s: float
    bubble: float


def step_time(job: JobPlan, dev: Device) -> tuple[float, float]:
    """(seconds, bubble) of the planned job under the cost model in the module docstring."""
    p, t = job.cfg.parallel, job.cfg.training
    d = job.cfg.model.dim
    tokens = job.microbatch * t.seq_len
    recompute = {"full": 4 / 3, "selective": 1.1}.get(p.activation_checkpoint, 1.0)
    est = job.schedules[0]
    worst = 0.0
    for r, walk in zip(job.ranks, est.walks):
        stages = job.plan.for_rank(r.pp_rank)
        flops = sum(s.cost for s in stages) * tokens * p.microbatches * recompute / p.tp
        compute = flops / dev.peak_flops
        blocks = sum(len(s.blocks) for s in stages)
        ar = 2 * (p.tp - 1) / p.tp * tokens * d * 2 / dev.nvlink_bw if p.tp > 1 else 0.0
        tp_time = 4 * blocks * p.microbatches * ar
        bw = dev.nvlink_bw if p.tp * p.dp_shard <= NODE else dev.ib_bw
        fsdp = comm_bytes(r, walk) * (p.dp_shard - 1) / max(p.dp_shard, 1) / bw
        worst = max(worst, (compute + tp_time) * (1 + est.bubble_simulated) + max(0.0, fsdp - compute))
    return worst, est.bubble_simulated


def _layouts(cfg: JobConfig, world: int):
    layers = cfg.model.n_layers
    for tp, pp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16, 32)):
        if world % (tp * pp) or cfg.model.n_heads % tp or (cfg.model.n_kv_heads or cfg.model.n_heads) % tp:
            continue
        dp = world // (tp * pp)
        for rep in sorted({1, dp // NODE} - {0}) if dp > NODE else (1,):
            for sched, spr in (("1F1B", 1), ("Interleaved1F1B", 2)) if pp > 1 else (("1F1B", 1),):
                if pp * spr > layers:
                    continue
                for m in sorted({pp, 2 * pp, 4 * pp}):
                    if cfg.training.batch_size % (dp * m):
                        continue
                    for ac in ("none", "selective", "full"):
                        yield dict(
                            pp=pp, tp=tp, dp_replicate=rep, dp_shard=dp // rep, schedule=sched,
                            stages_per_rank=spr, microbatches=m, activation_checkpoint=ac,
                        )  # fmt: skip


def search(cfg: JobConfig, world: int, budget_gib: float, dev: Device, top: int) -> list[Candidate]:
    """The `top` fitting layouts, fastest first; FSDP policies are "auto" under the budget for each."""
    found = []
    for kw in _layouts(cfg, world):
        pcfg = dataclasses.replace(
            cfg.parallel, **kw, fsdp_reshard_after_forward="auto", fsdp_grad_reduce="auto",
            memory_budget_gib=budget_gib, split="balanced", layers_per_stage=None, stage_fqns=None,
        )  # fmt: skip
        try:
            job = plan_job(dataclasses.replace(cfg, parallel=pcfg), world)
        except ConfigError:
            continue  # does not fit (or not a valid layout for this model)
        seconds, bubble = step_time(job, dev)
        keys = {k: getattr(job.policies, k) for k in PARALLEL_KEYS + POLICY_KEYS}
        found.append(Candidate(keys, job.peak_bytes / GIB, seconds, bubble))
    return sorted(found, key=lambda c: c.step_time_s)[:top]


__all__ = ["DEVICES", "Candidate", "Device", "search", "step_time"]
