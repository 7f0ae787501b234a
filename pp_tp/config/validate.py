"""Cross-key and cross-section checks on the config alone, before any process group or model exists."""

from __future__ import annotations

import dataclasses
import os

from pp_tp.config.fields import checked
from pp_tp.config.fsdp_policy import check_policy_keys, schedule_reshard
from pp_tp.config.schema import SPLIT_ARGS, JobConfig, ParallelConfig, TrainingConfig
from pp_tp.config.sections import (
    check_balancing_keys,
    check_checkpoint,
    check_context_parallel_job,
    check_data,
    check_model_kind,
    check_moe,
    check_non_lm_job,
    check_validation,
)
from pp_tp.errors import ConfigError
from pp_tp.schedules.registry import check_schedule, default_stages_per_rank


def validate(cfg: JobConfig, world_size: int | None = None) -> JobConfig:
    """Checks every section and their combinations on the config alone; returns a resolved copy.

    What needs the model itself (shapes TP must divide, layer counts, tied weights, plans) is checked by
    `pp_tp.preflight`, which `build_pipeline` and every CLI command run on the (meta) model.

    `world_size` None means env WORLD_SIZE if set, else the product of the degrees. The first failure
    raises ConfigError with one line naming the key, the value and the fix.
    """
    parallel = resolve_parallel(cfg.parallel, world_size)
    model = check_model_kind(checked("model", cfg.model))
    check_moe(model)
    job = JobConfig(
        model=model,
        parallel=parallel,
        training=_check_training(cfg.training, parallel),
        data=check_data(checked("data", cfg.data)),
        checkpoint=check_checkpoint(cfg.checkpoint),
        validation=check_validation(checked("validation", cfg.validation), cfg.data),
        moe=check_balancing_keys(cfg.moe),
    )
    check_non_lm_job(job)  # across sections, on type-checked values
    check_context_parallel_job(job)
    return job


def resolve_parallel(pcfg: ParallelConfig, world_size: int | None = None) -> ParallelConfig:
    """Checks `[parallel]` on its own (types, degrees vs world size, enums, schedule, split lists).

    Returns a copy with dp_shard = -1 replaced by the rest of the world and stages_per_rank filled from
    the schedule when unset; `world_size` None as in `validate`.
    """
    p = checked("parallel", pcfg)
    if p.dp_shard < 1 and p.dp_shard != -1:
        raise ConfigError(
            f"parallel.dp_shard = {p.dp_shard} must be >= 1, or -1 for the rest of the world; "
            "set parallel.dp_shard = -1"
        )
    spr = p.stages_per_rank if p.stages_per_rank is not None else default_stages_per_rank(p.schedule, p.pp)
    p = dataclasses.replace(p, dp_shard=resolve_dp_shard(p, _world_size(p, world_size)), stages_per_rank=spr)
    check_ep(p.ep, p.dp_shard, p.cp)
    check_policy_keys(p)
    _check_grad_accum(p)
    _check_float64(p)
    check_schedule(p.pp, p.stages_per_rank, p.microbatches, p.schedule, schedule_reshard(p))
    _check_split_lists(p)
    return p


def _world_size(p: ParallelConfig, world_size: int | None) -> int:
    if world_size is None:
        env = os.environ.get("WORLD_SIZE")
        if env is None:
            return p.pp * p.tp * p.dp_replicate * max(p.dp_shard, 1) * p.cp
        if not env.strip().isdigit():
            raise ConfigError(
                f"environment WORLD_SIZE = {env!r} is not an integer; unset it or set it to the number of ranks"
            )
        world_size = int(env)
    if world_size < 1:
        raise ConfigError(f"world size {world_size} must be >= 1; pass the number of ranks (--world-size N)")
    return world_size


def resolve_dp_shard(p: ParallelConfig, world: int) -> int:
    """dp_shard for a world of `world` ranks (-1: the rest); refuses degrees whose product is not the world."""
    others = p.pp * p.tp * p.dp_replicate * p.cp
    cp_name, cp_value = ("*cp", f"*{p.cp}") if p.cp > 1 else ("", "")
    degrees = f"pp*tp*dp_replicate{cp_name} = {p.pp}*{p.tp}*{p.dp_replicate}{cp_value} = {others}"
    if p.dp_shard == -1:
        if world % others:
            raise ConfigError(
                f"parallel.dp_shard = -1 cannot fill world size {world}: {degrees} does not divide it; "
                "change parallel.pp, parallel.tp or parallel.dp_replicate so that their product "
                f"divides {world}"
            )
        return world // others
    if others * p.dp_shard != world:
        fix = (
            f"set parallel.dp_shard = {world // others} (or -1)"
            if world % others == 0
            else f"change parallel.pp, parallel.tp or parallel.dp_replicate so that their product divides {world}"
        )
        raise ConfigError(
            f"parallel.dp_shard = {p.dp_shard}: {degrees} times dp_shard is {others * p.dp_shard} "
            f"but the world size is {world}; {fix}"
        )
    return p.dp_shard


def check_ep(ep: int, dp_shard: int, cp: int = 1) -> None:
    """Expert parallel is carved out of dp_shard (torchtitan's and Megatron's choice), so ep must divide it; under
    context parallel out of dp_shard x cp, every cp rank in the EP group (ep a multiple of cp)."""
    if cp > 1 and ep > 1 and (ep % cp or dp_shard % (ep // cp)):
        raise ConfigError(
            f"parallel.ep = {ep} with parallel.cp = {cp}: the EP group spans all cp ranks and part of dp_shard = "
            f"{dp_shard}, so ep must be cp times a divisor of dp_shard; set parallel.ep to one of "
            f"{', '.join(str(cp * d) for d in range(1, dp_shard + 1) if dp_shard % d == 0)}"
        )
    if cp == 1 and dp_shard % ep:
        raise ConfigError(
            f"parallel.ep = {ep} does not divide parallel.dp_shard = {dp_shard} (the EP group is carved out of "
            f"dp_shard); set parallel.ep to a divisor of {dp_shard} or raise parallel.dp_shard"
        )


def _check_float64(p: ParallelConfig) -> None:
    """float64 runs every tensor in float64: nothing may cast it down."""
    if p.dtype != "float64":
        return
    for key, value, fix in (("mixed_precision", p.mixed_precision, '"fp32"'), ("float8", p.float8, "false")):
        if value not in ("fp32", False):
            raise ConfigError(
                f'parallel.dtype = "float64" runs every tensor in float64, and parallel.{key} = {value!r} casts them '
                f"down; set parallel.{key} = {fix}"
            )


def _check_grad_accum(p: ParallelConfig) -> None:
    """bf16 gradient accumulation only under bf16 training."""
    if p.grad_accum_dtype == "bf16" and p.mixed_precision != "bf16":
        raise ConfigError(
            f'parallel.grad_accum_dtype = "bf16" needs parallel.mixed_precision = "bf16" (it is '
            f'{p.mixed_precision!r}); set parallel.grad_accum_dtype = "fp32"'
        )


def _check_split_lists(p: ParallelConfig) -> None:
    """The per-stage list a split needs: present, one entry per stage, sane entries."""
    key = SPLIT_ARGS.get(p.split)
    value = getattr(p, key) if key else None
    n = p.num_stages
    if key and value is None:
        raise ConfigError(
            f"parallel.split = {p.split!r} needs parallel.{key} with one entry per stage ({n}); "
            f"add parallel.{key} or choose another parallel.split"
        )
    if key and len(value) != n:
        raise ConfigError(
            f"parallel.{key} has {len(value)} entries but there are {n} stages "
            f"(parallel.pp * parallel.stages_per_rank); give exactly {n}"
        )
    if any(count < 0 for count in p.layers_per_stage or ()):
        raise ConfigError(
            f"parallel.layers_per_stage = {p.layers_per_stage} has a negative count; make every count >= 0"
        )
    for stage, fqns in enumerate(p.stage_fqns or ()):
        if not fqns:
            raise ConfigError(f"parallel.stage_fqns[{stage}] is empty; give every stage at least one module FQN")


def _check_training(training: TrainingConfig, p: ParallelConfig) -> TrainingConfig:
    t = checked("training", training)
    multiple = p.dp * p.microbatches
    if t.batch_size % multiple:
        raise ConfigError(
            f"training.batch_size = {t.batch_size} gives a local batch of {t.batch_size / p.dp:g} "
            f"per DP rank (dp = {p.dp}), which does not split into parallel.microbatches = "
            f"{p.microbatches}; set training.batch_size to a multiple of dp * microbatches = {multiple}"
        )
    if not 0.0 < t.grpo_clip < 1.0 or t.grpo_kl_coef < 0.0:  # Pipeline.step(..., loss_fn="grpo")'s epsilon, beta
        raise ConfigError(
            f"training.grpo_clip = {t.grpo_clip}, training.grpo_kl_coef = {t.grpo_kl_coef}: set a clip in (0, 1) "
            "and a KL coefficient >= 0"
        )
    return t
