"""`Pipeline.logprobs`: every label's log-probability under the model, forward-only through the schedule.

It runs torch's `schedule.eval` like `Pipeline.evaluate` (multi-stage schedules keep only their forward actions,
`evaluate.forward_only`), with the modules in eval mode (no dropout draws) and under no_grad; the last stage writes
each microbatch's log-probs into its rows (`extras.RowLoss.collect`), vocab-parallel under `parallel.loss_parallel`.
The result is summed over pp (zeros where a rank holds no last stage) so every rank of the DP rank's group returns
its rows, and under context parallel all-gathered over cp and put back in sequence order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.parallel.context_parallel import ContextParallel
from pp_tp.runtime.evaluate import forward_only, grad_state, kept_grads


@contextlib.contextmanager
def inference(parts: list[nn.Module]) -> Iterator[None]:
    """Eval mode (no dropout, so no RNG draw) and every gradient kept (`kept_grads`)."""
    modes = [(m, m.training) for part in parts for m in part.modules()]
    for part in parts:
        part.eval()
    try:
        with kept_grads(parts):
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def whole_sequences(local: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """[B, S] from every cp rank's head-tail chunks [B, S / cp] (ContextParallel.shard's inverse)."""
    parts = [torch.empty_like(local) for _ in range(cp.size)]
    dist.all_gather(parts, local.contiguous(), group=cp.group)
    seq = local.shape[1] * cp.size
    out = local.new_empty((local.shape[0], seq))
    for rank, part in enumerate(parts):
        out[:, cp.chunk_positions(seq, rank, local.device)] = part
    return out


@torch.no_grad()
def logprobs(
    pipe: Any, inputs: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 [batch, seq] of this DP rank's rows: log p(label) per token, 0.0 where the label is -100. `pipe`: the
    Pipeline (not imported: it imports this module)."""
    where = "Pipeline.logprobs"
    if pipe._targets:
        raise ConfigError(f"{where}: the pipeline was built with a loss_fn (not a language model); it has no labels")
    pipe._check_positions(where, inputs, position_ids)
    inputs, labels, position_ids = pipe._context_shard(where, inputs, labels, position_ids)
    inputs, labels, _ = pipe.prepare_batch(where, inputs, labels)
    kwargs = pipe._schedule_kwargs(inputs, position_ids)
    out = torch.zeros(labels.shape, dtype=torch.float32, device=pipe.device)
    before = grad_state(pipe.model_parts)
    args = (inputs,) if pipe.has_first_stage else ()
    with contextlib.ExitStack() as ctx:
        ctx.enter_context(inference(pipe.model_parts))
        ctx.enter_context(pipe._loss.parallel())
        ctx.enter_context(forward_only(pipe.schedule))
        for stage in pipe.model_parts:
            ctx.enter_context(stage.reuse_block_inputs())
        target = ctx.enter_context(pipe._rows.collect(out, labels if pipe.has_last_stage else None))
        pipe.schedule.eval(*args, target=target, losses=[], return_outputs=False, **kwargs)
    changed = [k for k, v in grad_state(pipe.model_parts).items() if before[k] != v]
    if changed:
        raise AssertionError(f"{where} changed the gradient of {changed[0]}; it must be forward-only")
    dist.all_reduce(out, group=pipe._pp_group)  # one pp rank holds the rows, the others add zeros: exact
    return out if pipe._cp is None else whole_sequences(out, pipe._cp)
