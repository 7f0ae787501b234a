"""torchtitan (0.3.0) integration: pp_tp's builder behind torchtitan's model-spec `pipelining_fn`.

`model_spec("llama3", "debugmodel")` returns torchtitan's own ModelSpec with `pipelining_fn` swapped for
pp_tp's; put it in the Trainer config (docs/torchtitan.md has the command). torchtitan's Trainer calls
`pipelining_fn(model, parallel_dims=..., training=..., parallelism=..., compile_config=..., ac_config=...,
dump_folder=..., device=..., model_config=..., parallelize_fn=..., loss_fn=...)`, then `to_empty()` and
`init_weights(buffer_device=...)` on each part, and steps the returned schedule.

What differs from torchtitan's own `pipeline_llm`:
- `parallelize_fn` is not called: TP (without sequence parallel), AC, compile and FSDP2 come from
  pp_tp's passes, fed by the `parallelism`, `ac_config` and `compile_config` sections.
- `context_parallel_degree` is pp_tp's `parallel.cp` (K/V all-gathered over cp, head-tail chunks), not
  torchtitan's ring attention; a model whose attention cannot run under it is refused in one line by the build.
- `loss_fn` is replaced by pp_tp's exact loss: token-summed cross-entropy over the global count of
  non-ignored tokens, which is torchtitan's `global_valid_tokens` normalization (no gradient accumulation).
- `init_weights` draws each parameter with its module's own torchtitan `param_init`, from (seed, FQN).
- With TP, the modules TP leaves whole hold Replicate DTensors over tp, so the Trainer's clip_grad_norm_ and fused
  AdamW find every parameter of a part on one mesh (torchtitan_compat.py; torch 2.13's missing
  `torch.distributed.set_timeout` is put there too).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any

from torch import nn

from pp_tp.build import build_pipeline
from pp_tp.config import ParallelConfig, resolve_parallel
from pp_tp.errors import ConfigError
from pp_tp.integrations.torchtitan_compat import install_set_timeout, one_mesh_per_part
from pp_tp.integrations.torchtitan_parts import PipelineSchedule, init_part, init_rules
from pp_tp.parallel.mesh import build_mesh


def _ac_mode(ac_config: Any) -> str:
    name = type(ac_config).__qualname__ if ac_config is not None else "None"
    modes = {"None": "none", "FullAC.Config": "full", "SelectiveAC.Config": "selective"}
    if name not in modes:
        raise ConfigError(
            f"activation_checkpoint = {name}: pp_tp's pipelining_fn supports none, full and selective; pick one"
        )
    return modes[name]


def _refuse_unsupported(parallelism: Any, training: Any) -> None:
    if getattr(parallelism, "module_fqns_per_model_part", None):
        raise ConfigError(
            "parallelism.module_fqns_per_model_part: pp_tp's pipelining_fn splits stages itself; leave it unset"
        )
    mbs = parallelism.pipeline_parallel_microbatch_size
    if training.local_batch_size % mbs:
        raise ConfigError(
            f"training.local_batch_size = {training.local_batch_size} is not divisible by "
            f"parallelism.pipeline_parallel_microbatch_size = {mbs}; make it a multiple"
        )


def parallel_config(
    parallelism: Any, training: Any, ac_config: Any = None, compile_config: Any = None
) -> ParallelConfig:
    """Our `[parallel]` from torchtitan's config sections; refuses what we cannot honour, in one line."""
    _refuse_unsupported(parallelism, training)
    compiled = bool(compile_config and compile_config.enable and "model" in compile_config.components)
    pcfg = resolve_parallel(
        ParallelConfig(
            pp=parallelism.pipeline_parallel_degree,
            tp=parallelism.tensor_parallel_degree,
            dp_replicate=parallelism.data_parallel_replicate_degree,
            dp_shard=parallelism.data_parallel_shard_degree,
            ep=parallelism.expert_parallel_degree,
            cp=parallelism.context_parallel_degree,  # pp_tp's own context parallel: the model's rules decide
            schedule=parallelism.pipeline_parallel_schedule_csv or parallelism.pipeline_parallel_schedule,
            microbatches=training.local_batch_size // parallelism.pipeline_parallel_microbatch_size,
            fsdp_reshard_after_forward=parallelism.fsdp_reshard_after_forward,
            mixed_precision="bf16" if training.mixed_precision_param == "bfloat16" else "fp32",
            activation_checkpoint=_ac_mode(ac_config),
            compile=compiled,
            compile_backend=compile_config.backend if compiled else "inductor",
        )
    )
    if training.global_batch_size > 0 and training.global_batch_size != training.local_batch_size * pcfg.dp:
        raise ConfigError(
            f"training.global_batch_size = {training.global_batch_size}: gradient accumulation is not supported by "
            f"pp_tp's pipelining_fn; set it to -1 or local_batch_size * dp = {training.local_batch_size * pcfg.dp}"
        )
    return pcfg


def pipelining_fn(
    model: nn.Module,
    *,
    parallel_dims: Any,
    training: Any,
    parallelism: Any,
    compile_config: Any,
    ac_config: Any,
    dump_folder: str,
    device: Any,
    model_config: Any,
    parallelize_fn: Any,
    loss_fn: Any,
    seed: int = 0,
) -> tuple[PipelineSchedule, list[nn.Module], bool, bool]:
    """torchtitan 0.3.0's `pipelining_fn` contract, built by `pp_tp.build_pipeline` on the same world.

    Returns `(schedule, model_parts, has_first_stage, has_last_stage)`; each part gets `init_weights`
    (torchtitan's distributions from (seed, FQN)) and, for masked attention, the model's
    `get_attention_masks`.
    """
    pcfg = parallel_config(parallelism, training, ac_config, compile_config)
    install_set_timeout()
    mesh = build_mesh(pcfg)
    one_mesh_per_part(model, pcfg, mesh)  # before the build: FSDP must find them on the TP mesh
    pipe = build_pipeline(model, mesh, pcfg, seed=seed, seq_len=training.seq_len)
    rules, n_layers = init_rules(model), len(model.layers) if hasattr(model, "layers") else 0
    for part in pipe.model_parts:
        part.init_weights = functools.partial(init_part, part, seed, rules, n_layers)
        if hasattr(model, "get_attention_masks"):  # the Trainer builds masks through model_parts[0]
            part.get_attention_masks = model.get_attention_masks
    schedule = PipelineSchedule(pipe, training.local_batch_size, training.seq_len)
    return schedule, pipe.model_parts, pipe.has_first_stage, pipe.has_last_stage


def model_spec(name: str, flavor: str, seed: int = 0, **registry_kwargs: Any) -> Any:
    """torchtitan's ModelSpec for `name` (e.g. "llama3", "qwen3") and `flavor`, with pp_tp's `pipelining_fn`.

    `registry_kwargs` go to torchtitan's `model_registry` (e.g. `attn_backend="flex"`).
    """
    install_set_timeout()  # torchtitan's own path (pipeline_parallel_degree = 1) needs it as well
    spec = importlib.import_module(f"torchtitan.models.{name}").model_registry(flavor, **registry_kwargs)
    return dataclasses.replace(spec, pipelining_fn=functools.partial(pipelining_fn, seed=seed))
