"""What torchtitan's Trainer holds after pp_tp's `pipelining_fn`: the `pp_schedule` it steps and the
`init_weights` it calls on every model part after `to_empty()`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pp_tp.base.seeded_init import default_init_std, seed_of, seeded_value
from pp_tp.base.tensors import copy_full_
from pp_tp.errors import ConfigError
from pp_tp.models.torchtitan import set_step_kwargs
from pp_tp.runtime.pipeline import Pipeline
from pp_tp.stages.stage_module import canonical_names

STEP_KWARGS = ("positions", "attention_masks")


def _local(value: Any) -> Any:
    """This rank's part of an input torchtitan wrapped as a DTensor (`spmd_backend = "full_dtensor"`: rows sharded
    over DP, replicated over TP); anything else as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


class PipelineSchedule:
    """torchtitan's `pp_schedule`: `step(arg_mbs=, kwarg_mbs=, target_mbs=, losses=, loss_kwargs=)` on every rank.

    The microbatches torchtitan's data loader made are joined into this DP rank's batch for
    `Pipeline.step` (which cuts it the same way again). Per-microbatch `positions` and `attention_masks`
    go to every local stage, in microbatch order; any other kwarg is refused. `losses` gets one entry,
    the global loss / dp, so torchtitan's sum over microbatches and then over DP ranks is the global loss.
    Normalization: torchtitan divides by `global_valid_tokens` (non-ignored labels over DP ranks and
    gradient-accumulation groups); pp_tp by its count over DP ranks, the same number because gradient
    accumulation is refused (parallel_config). Inputs torchtitan wraps as DTensors (spmd_backend "full_dtensor")
    are read as this rank's local tensors.
    """

    def __init__(self, pipe: Pipeline, local_batch_size: int, seq_len: int):
        self.pipe, self.local_batch_size, self.seq_len = pipe, local_batch_size, seq_len

    def _stage_kwargs(self, kwarg_mbs: list[dict[str, Any]] | None) -> None:
        m = self.pipe.pcfg.microbatches
        if kwarg_mbs and len(kwarg_mbs) != m:
            raise ConfigError(f"pp_schedule.step got {len(kwarg_mbs)} kwarg microbatches for {m} microbatches")
        extra = sorted({k for kw in kwarg_mbs or () for k in kw} - set(STEP_KWARGS))
        if extra:
            raise ConfigError(
                f"model forward kwargs {extra}: pp_tp's pipelining_fn hands its stages only {list(STEP_KWARGS)}; "
                "drop them from the data loader's input dict"
            )
        per_mb = [{k: _local(v) for k, v in kw.items() if v is not None} for kw in kwarg_mbs or [{}] * m]
        for part in self.pipe.model_parts:
            set_step_kwargs(part, per_mb)

    def step(
        self,
        *args: torch.Tensor,
        target: torch.Tensor | None = None,
        losses: list | None = None,
        arg_mbs: list[tuple[torch.Tensor, ...]] | None = None,
        kwarg_mbs: list[dict[str, Any]] | None = None,
        target_mbs: list[torch.Tensor] | None = None,
        loss_kwargs: dict[str, Any] | None = None,
        return_outputs: bool = False,
    ) -> None:
        """One pipeline step; whole-batch `(ids, target=)` or torchtitan 0.3.0's microbatch lists."""
        if return_outputs:
            raise ConfigError("pp_schedule.step(return_outputs=True): pp_tp returns no outputs; pass False")
        ids = _local(args[0]) if args else torch.cat([_local(a[0]) for a in arg_mbs]) if arg_mbs else None
        target_mbs = [target] if target is not None else target_mbs
        labels = torch.cat([_local(t) for t in target_mbs]) if target_mbs else None
        if ids is None:  # ranks without the first stage: Pipeline.step needs only the shape
            ids = torch.zeros(self.local_batch_size, self.seq_len, dtype=torch.long)
        if labels is None:  # ranks without the last stage: labels feed only the last stage's loss
            labels = torch.zeros_like(ids)
        self._stage_kwargs(kwarg_mbs)
        loss = self.pipe.step(ids, labels)
        if losses is not None:
            losses.append(loss / self.pipe.pcfg.dp)


def _init_rule(module: nn.Module, name: str) -> Callable[[torch.Tensor], Any] | None:
    """The module's own torchtitan `param_init` for `name`; None when it has none (or skips the param)."""
    rules = getattr(module, "_param_init", None) or {}
    fn = rules.get(name)
    return None if fn is None or getattr(fn, "__name__", "") == "skip_param_init" else fn


def init_rules(model: nn.Module) -> dict[str, Callable[[torch.Tensor], Any] | None]:
    """Canonical parameter key (the first name the model lists a parameter under) -> its torchtitan init.

    A tied weight takes the rule of the name that does not skip it (torchtitan skips the embedding's).
    """
    rules: dict[str, Callable[[torch.Tensor], Any] | None] = {}
    for name, key in canonical_names(model).items():
        parent, _, leaf = name.rpartition(".")
        fn = _init_rule(model.get_submodule(parent) if parent else model, leaf)
        if rules.get(key) is None:
            rules[key] = fn
    return rules


@torch.no_grad()
def init_part(
    part: nn.Module, seed: int, rules: dict[str, Any], n_layers: int, buffer_device: torch.device | None = None
) -> None:
    """torchtitan's `init_weights` for a pp_tp part: each parameter drawn with its torchtitan `param_init`
    (`rules`, by canonical key) on the full tensor from a generator seeded by (seed, key), then sliced into
    the shard; then each torchtitan module's buffers (RoPE caches). Values depend on (seed, key) only, so
    tied copies on different stages start equal."""
    keys = getattr(part, "checkpoint_keys", {})
    for name, p in part.named_parameters():
        key = keys.get(name, name)
        fn = rules.get(key)
        if fn is None:  # no torchtitan rule: pp_tp's default
            copy_full_(p, seeded_value(seed, key, p.shape, default_init_std(key, n_layers)))
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed_of(seed, key))
            full = torch.empty(p.shape, dtype=torch.float32)
            fn(full)
        copy_full_(p, full)
    for module in part.modules():
        if hasattr(module, "_init_self_buffers"):
            module._init_self_buffers(buffer_device=buffer_device)
