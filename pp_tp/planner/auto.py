"""`"auto"` FSDP policies: per pp rank, the least-communication (reshard, grad-reduce) pair whose predicted
peak fits `parallel.memory_budget_gib`, from the dry run's stage sizes and the schedule's own action order.
`choose` is the one selection rule, for `pp-tp plan` / `pp-tp train` (resolve_policies) and the layout search
(pp_tp.planner.layout_eval) alike."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pp_tp.config import ParallelConfig
from pp_tp.config.fsdp_policy import FsdpPolicy, per_rank
from pp_tp.errors import ConfigError
from pp_tp.planner.memory import RankMemory, peak_held_bytes
from pp_tp.planner.walk import Walk, walk_step
from pp_tp.schedules.registry import get_schedule_spec, is_csv_schedule

GIB = 2**30
Pair = tuple[str | int, str | int]  # (fsdp_reshard_after_forward, fsdp_grad_reduce) values


def comm_bytes(rank: RankMemory, walk: Walk) -> int:
    """FSDP bytes a rank moves per step: all-gathered parameters and reduce-scattered gradients."""
    return sum(
        walk.all_gathers[s] * size.gathered + walk.reduce_scatters[s] * size.grads for s, size in rank.sizes.items()
    )


def options(pcfg: ParallelConfig, pp_rank: int) -> list[Pair]:
    """The pairs "auto" may pick from on `pp_rank`, a fixed value staying fixed."""
    reshard = per_rank(pcfg.fsdp_reshard_after_forward, pcfg.pp)[pp_rank]
    reduce = per_rank(pcfg.fsdp_grad_reduce, pcfg.pp)[pp_rank]
    split = not is_csv_schedule(pcfg.schedule) and get_schedule_spec(pcfg.schedule).splits_weight_grad
    reshards = [reshard] if reshard != "auto" else ["default"] + ([] if split else ["always"])
    m, ks = pcfg.microbatches, []
    k = m // 2
    while k > 1:
        ks.append(k)
        k //= 2
    reduces = [reduce] if reduce != "auto" else ["step", *ks, "microbatch"]
    return [(r, g) for r in reshards for g in reduces]


def choose(
    rank: RankMemory,
    actions: list,
    pcfg: ParallelConfig,
    counts: Callable[[FsdpPolicy], Walk] | None = None,
    walks: dict[FsdpPolicy, Walk] | None = None,
) -> Pair | None:
    """This rank's pair: of the options whose predicted peak fits the budget, the one moving the fewest FSDP
    bytes, then the one with the smallest peak, then the first listed; None when none fits.

    Peaks are walked in order of bytes moved, stopping at the first option moving more than one that fits.
    `counts(policy)` gives the walk whose collective counts to use: they depend on the action order and the
    policy only, so the layout search caches them across layouts; by default the rank's own walk. `walks`, when
    given, keeps the walks this rank's peaks were read from (the search settles the rank with the picked one).
    A rank whose activations alone, at the schedule's moment of most held (peak_held_bytes: every walk holds
    them then), leave no room is refused before any walk."""
    walks = {} if walks is None else walks
    budget = pcfg.memory_budget_gib * GIB
    if rank.peak(peak_held_bytes(actions, rank.act_bytes_per_microbatch)) > budget:
        return None  # every policy's walk holds at least these activations at that moment: none fits

    def walk(policy: FsdpPolicy) -> Walk:
        if policy not in walks:
            walks[policy] = walk_step(actions, rank.sizes, policy, pcfg.microbatches)
        return walks[policy]

    counts = counts or walk
    tried = [(pair, FsdpPolicy.of(pcfg, *pair)) for pair in options(pcfg, rank.pp_rank)]
    ranked = sorted((comm_bytes(rank, counts(policy)), i, pair, policy) for i, (pair, policy) in enumerate(tried))
    best = None
    for moved, _, pair, policy in ranked:
        if best is not None and moved > best[0]:
            break
        peak = rank.peak(walk(policy).peak)
        if peak <= budget and (best is None or peak < best[1]):
            best = (moved, peak, pair)
    return best[2] if best else None


def _no_fit(rank: RankMemory, actions: list, pcfg: ParallelConfig) -> ConfigError:
    """The one line when no option fits: the smallest peak, and what dominates it."""
    walks = {pair: walk_step(actions, rank.sizes, FsdpPolicy.of(pcfg, *pair), pcfg.microbatches)
             for pair in options(pcfg, rank.pp_rank)}  # fmt: skip
    (r, g), walk = min(walks.items(), key=lambda kv: rank.peak(kv[1].peak))
    parts = {
        "sharded state, receive buffers and backward transients": rank.fixed_bytes,
        "activations": walk.act,
        "gathered parameters": walk.gathered,
        "unsharded gradients": walk.grads,
        "the optimizer step's temporary": rank.optim_step_bytes,
    }
    what, size = max(parts.items(), key=lambda kv: kv[1])
    return ConfigError(
        f"parallel.memory_budget_gib = {pcfg.memory_budget_gib:g}: no FSDP policy fits pp rank {rank.pp_rank}; "
        f"the smallest predicted peak is {rank.peak(walk.peak) / GIB:.4g} GiB (fsdp_reshard_after_forward = {r!r}, "
        f"fsdp_grad_reduce = {g!r}), dominated by {what} ({size / GIB:.4g} GiB); raise the budget or change "
        "the layout (pp-tp plan --search)"
    )


def with_picks(pcfg: ParallelConfig, picks: list[Pair]) -> ParallelConfig:
    """`pcfg` with each key set to the picks: one value when every pp rank's is the same, else a per-rank list."""
    reshard, reduce = [x[0] for x in picks], [x[1] for x in picks]
    return dataclasses.replace(
        pcfg,
        fsdp_reshard_after_forward=reshard if len(set(reshard)) > 1 else reshard[0],
        fsdp_grad_reduce=reduce if len(set(reduce)) > 1 else reduce[0],
    )


def resolve_policies(ranks: list[RankMemory], actions: list[list], pcfg: ParallelConfig) -> ParallelConfig:
    """`pcfg` with "auto" replaced by per-pp-rank picks (unchanged when nothing is "auto"); ConfigError (one
    line) when no option fits a rank."""
    if "auto" not in (pcfg.fsdp_reshard_after_forward, pcfg.fsdp_grad_reduce):
        return pcfg
    picks = []
    for rank in ranks:
        pick = choose(rank, actions[rank.pp_rank], pcfg)
        if pick is None:
            raise _no_fit(rank, actions[rank.pp_rank], pcfg)
        picks.append(pick)
    return with_picks(pcfg, picks)
