"""`"auto"` FSDP policies resolved for a run, before its process group starts, and the line saying what
was chosen (pp-tp train prints it at startup)."""

from __future__ import annotations

import dataclasses
import os

from pp_tp.config import JobConfig
from pp_tp.config.fsdp_policy import per_rank
from pp_tp.planner.auto import GIB
from pp_tp.planner.dry_run import plan_job


def has_auto(cfg: JobConfig) -> bool:
    """True when an FSDP policy is "auto" (the planner must pick it before the process group starts)."""
    return "auto" in (cfg.parallel.fsdp_reshard_after_forward, cfg.parallel.fsdp_grad_reduce)


def world_size_of(cfg: JobConfig) -> int:
    """$WORLD_SIZE under torchrun, else the product of the configured degrees."""
    return int(os.environ.get("WORLD_SIZE") or cfg.parallel.world_size)


def resolve_auto(cfg: JobConfig, world_size: int | None = None) -> tuple[JobConfig, str | None]:
    """`cfg` with "auto" replaced by the planner's per-pp-rank picks (pp_tp.planner.auto) and the line that
    names them; `cfg` and None when nothing is "auto". Runs the dry run in this process, so it must run
    before the process group exists; ConfigError (one line) when no policy fits the budget."""
    if not has_auto(cfg):
        return cfg, None
    job = plan_job(cfg, world_size or world_size_of(cfg))
    p = job.policies
    reshard, reduce = per_rank(p.fsdp_reshard_after_forward, p.pp), per_rank(p.fsdp_grad_reduce, p.pp)
    picks = "; ".join(
        f"pp rank {r.pp_rank}: reshard_after_forward={reshard[r.pp_rank]} grad_reduce={reduce[r.pp_rank]} "
        f"(peak {r.total_bytes / GIB:.3f} GiB)"
        for r in job.ranks
    )
    line = f"FSDP policies (auto, parallel.memory_budget_gib = {p.memory_budget_gib:g}): {picks}"
    return dataclasses.replace(cfg, parallel=p), line
