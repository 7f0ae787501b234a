"""`"auto"` FSDP policies: per pp rank, the least-communication (reshard, grad-reduce) pair whose predicted
peak fits `parallel.memory_budget_gib`, from the dry run's stage sizes and the schedule's own action order."""

from __future__ import annotations

import dataclasses

from pp_tp.config import ParallelConfig
from pp_tp.config.validate import per_rank
from pp_tp.errors import ConfigError
from pp_tp.planner.memory import RankMemory, stage_policy
from pp_tp.planner.walk import Walk, walk_step
from pp_tp.schedules.registry import get_schedule_spec, is_csv_schedule

GIB = 2**30


def comm_bytes(rank: RankMemory, walk: Walk) -> int:
    """FSDP bytes a rank moves per step: all-gathered parameters and reduce-scattered gradients."""
    return sum(
        walk.all_gathers[s] * size.gathered + walk.reduce_scatters[s] * size.grads for s, size in rank.sizes.items()
    )


def options(pcfg: ParallelConfig, reshard: str | int, reduce: str | int) -> list[tuple[str | int, str | int]]:
    """The (reshard, grad_reduce) pairs "auto" may pick from, a fixed value staying fixed."""
    split = not is_csv_schedule(pcfg.schedule) and get_schedule_spec(pcfg.schedule).splits_weight_grad
    reshards = [reshard] if reshard != "auto" else ["default"] + ([] if split else ["always"])
    m, ks = pcfg.microbatches, []
    k = m // 2
    while k > 1:
        ks.append(k)
        k //= 2
    reduces = [reduce] if reduce != "auto" else ["step", *ks, "microbatch"]
    return [(r, g) for r in reshards for g in reduces]


def _walk(rank: RankMemory, actions: list, pcfg: ParallelConfig) -> Walk:
    return walk_step(actions, rank.sizes, {s: stage_policy(pcfg) for s in rank.stages}, pcfg.microbatches)


def choose(rank: RankMemory, actions: list, pcfg: ParallelConfig) -> tuple[str | int, str | int]:
    """This rank's pair: the fitting one moving the fewest bytes (then the smallest peak); ConfigError if none fits."""
    reshard = per_rank(pcfg.fsdp_reshard_after_forward, pcfg.pp)[rank.pp_rank]
    reduce = per_rank(pcfg.fsdp_grad_reduce, pcfg.pp)[rank.pp_rank]
    static = rank.fixed_bytes
    scored = []
    for r, g in options(pcfg, reshard, reduce):
        trial = dataclasses.replace(pcfg, fsdp_reshard_after_forward=r, fsdp_grad_reduce=g)
        walk = _walk(rank, actions, trial)
        scored.append((rank.peak(walk.peak), comm_bytes(rank, walk), (r, g), walk))
    fitting = [x for x in scored if x[0] <= pcfg.memory_budget_gib * GIB]
    if fitting:
        return min(fitting, key=lambda x: (x[1], x[0]))[2]
    peak, _, (r, g), walk = min(scored, key=lambda x: x[0])
    parts = {
        "sharded state, receive buffers and backward transients": static,
        "activations": walk.act,
        "gathered parameters": walk.gathered,
        "unsharded gradients": walk.grads,
        "the optimizer step's temporary": rank.optim_step_bytes,
    }
    what, size = max(parts.items(), key=lambda kv: kv[1])
    raise ConfigError(
        f"parallel.memory_budget_gib = {pcfg.memory_budget_gib:g}: no FSDP policy fits pp rank {rank.pp_rank}; "
        f"the smallest predicted peak is {peak / GIB:.4g} GiB (fsdp_reshard_after_forward = {r!r}, "
        f"fsdp_grad_reduce = {g!r}), dominated by {what} ({size / GIB:.4g} GiB); raise the budget or change "
        "the layout (pp-tp plan --search)"
    )


def resolve_policies(ranks: list[RankMemory], actions: list[list], pcfg: ParallelConfig) -> ParallelConfig:
    """`pcfg` with "auto" replaced by per-pp-rank lists (unchanged when nothing is "auto")."""
    if "auto" not in (pcfg.fsdp_reshard_after_forward, pcfg.fsdp_grad_reduce):
        return pcfg
    picks = [choose(r, actions[r.pp_rank], pcfg) for r in ranks]
    reshard, reduce = [p[0] for p in picks], [p[1] for p in picks]
    return dataclasses.replace(
        pcfg,
        fsdp_reshard_after_forward=reshard if len(set(reshard)) > 1 else reshard[0],
        fsdp_grad_reduce=reduce if len(set(reduce)) > 1 else reduce[0],
    )
