"""torchtitan integration: our builder behind torchtitan's model-spec `pipelining_fn`.

Set `pipelining_fn=pp_tp.integrations.torchtitan.pipelining_fn` in a TrainSpec (the model needs a pp_tp
model layout: the reference Transformer has one, others register theirs). torchtitan calls it as
`pipelining_fn(model, parallel_dims, job_config, device, model_args, parallelize_fn, loss_fn)` and gets
back `(schedule, model_parts, has_first_stage, has_last_stage)`; newer torchtitan passes `training=` and
`parallelism=` sections by keyword instead of `job_config`, which works too.

What differs from torchtitan's own `pipeline_llm`:
- `parallelize_fn` is not called: TP, FSDP2 (and the other passes) come from pp_tp's own passes, fed by
  the job's `[parallelism]` degrees, so stage splitting and sharding stay consistent with each other.
- `loss_fn` is replaced by pp_tp's exact loss: the token-summed cross-entropy over the global count of
  non-ignored tokens (equal to torchtitan's mean cross-entropy when nothing is padded).
- `losses` receives one entry per step, the global loss, so torchtitan's mean over it is that loss.
- Gradient accumulation (global_batch_size > local_batch_size * dp) is refused: each schedule step is a
  whole optimizer step's loss normalization.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pp_tp.config import ParallelConfig, resolve_parallel
from pp_tp.errors import ConfigError
from pp_tp.schedules.pipeline import Pipeline


class PipelineSchedule:
    """The object torchtitan keeps as `pp_schedule`: `step(*inputs, target=, losses=, input_batch=)` on every rank."""

    def __init__(self, pipe: Pipeline, local_batch_size: int, seq_len: int):
        self.pipe, self.local_batch_size, self.seq_len = pipe, local_batch_size, seq_len

    def step(
        self,
        *args: torch.Tensor,
        target: torch.Tensor | None = None,
        losses: list | None = None,
        input_batch: torch.Tensor | None = None,
        **_: Any,
    ) -> None:
        # Ranks without the first stage may get no ids, and ranks without the last no labels: Pipeline.step
        # only needs their shape there (and labels' token count, which only the last stage's loss uses).
        ids = args[0] if args else input_batch
        if ids is None:
            ids = torch.zeros(self.local_batch_size, self.seq_len, dtype=torch.long)
        labels = target if target is not None else torch.zeros_like(ids)
        loss = self.pipe.step(ids, labels)
        if losses is not None:
            losses.append(loss)


def _seeded_init(part: nn.Module, model: nn.Module, seed: int):
    """The `init_weights(buffer_device=None)` torchtitan calls on a part after `to_empty()`."""
    from pp_tp.stages.build import fill_stage

    def init_weights(buffer_device: Any = None) -> None:
        fill_stage(part, model, seed, None)  # buffers are recomputed on the part's own device

    return init_weights


def parallel_config(parallelism: Any, training: Any) -> ParallelConfig:
    """Our `[parallel]` from torchtitan's `parallelism` and `training` sections; refuses what we cannot honour."""
    for key in ("context_parallel_degree", "expert_parallel_degree"):
        if getattr(parallelism, key, 1) > 1:
            raise ConfigError(
                f"parallelism.{key} = {getattr(parallelism, key)}: not supported by pp_tp's pipelining_fn; set it to 1"
            )
    mbs = parallelism.pipeline_parallel_microbatch_size
    if training.local_batch_size % mbs:
        raise ConfigError(
            f"training.local_batch_size = {training.local_batch_size} is not divisible by "
            f"parallelism.pipeline_parallel_microbatch_size = {mbs}; make it a multiple"
        )
    schedule = parallelism.pipeline_parallel_schedule_csv or parallelism.pipeline_parallel_schedule
    pp = parallelism.pipeline_parallel_degree
    pcfg = resolve_parallel(
        ParallelConfig(
            pp=pp,
            tp=parallelism.tensor_parallel_degree,
            dp_replicate=parallelism.data_parallel_replicate_degree,
            dp_shard=parallelism.data_parallel_shard_degree,
            schedule=schedule,
            microbatches=training.local_batch_size // mbs,
            fsdp_reshard_after_forward=getattr(parallelism, "fsdp_reshard_after_forward", "default"),
            mixed_precision="bf16" if training.mixed_precision_param == "bfloat16" else "fp32",
        )
    )
    if training.global_batch_size > 0 and training.global_batch_size != training.local_batch_size * pcfg.dp:
        raise ConfigError(
            f"training.global_batch_size = {training.global_batch_size}: gradient accumulation is "
            f"not supported by pp_tp's pipelining_fn; set it to -1 or local_batch_size * dp = "
            f"{training.local_batch_size * pcfg.dp}"
        )
    return pcfg


def pipelining_fn(
    model: nn.Module,
    parallel_dims: Any = None,
    job_config: Any = None,
    device: Any = None,
    model_args: Any = None,
    parallelize_fn: Any = None,
    loss_fn: Any = None,
    *,
    training: Any = None,
    parallelism: Any = None,
    **_: Any,
) -> tuple[PipelineSchedule, list[nn.Module], bool, bool]:
    """torchtitan's `pipelining_fn` contract, built by `pp_tp.build_pipeline` on a mesh of the same world.

    torchtitan then calls `to_empty()` and `init_weights(buffer_device=...)` on every part: each part's
    `init_weights` refills it with pp_tp's seeded init (a function of seed and FQN only).
    """
    import pp_tp

    training = training or job_config.training
    parallelism = parallelism or job_config.parallelism
    pcfg = parallel_config(parallelism, training)
    seed = training.seed or 0
    pipe = pp_tp.build_pipeline(model, pp_tp.build_mesh(pcfg), pcfg, seed=seed, seq_len=training.seq_len)
    for part in pipe.model_parts:
        part.init_weights = _seeded_init(part, model, seed)
    schedule = PipelineSchedule(pipe, training.local_batch_size, training.seq_len)
    return schedule, pipe.model_parts, pipe.has_first_stage, pipe.has_last_stage
