"""Per-sample and per-token inputs beside the labels (`Pipeline.step(..., extras=, loss_fn=)`), and the log-probs of
`Pipeline.logprobs`, routed to the loss microbatch by microbatch.

torch's schedules split only the inputs and the target into microbatches (their `loss_kwargs` reach every microbatch
whole), so for such a call the target handed to the schedule is the rows' indices, [B]: torch splits it exactly as
it splits the inputs, and the loss (`RowLoss`, the schedule's loss_fn) reads each microbatch's labels and extras
by those indices. A call without extras hands the labels on as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from pp_tp.errors import ConfigError
from pp_tp.parallel.context_parallel import ContextParallel
from pp_tp.runtime.loss import scaled, vocab_parallel
from pp_tp.runtime.policy_loss import GrpoLoss, token_logprobs

ExtrasLoss = Callable[[torch.Tensor, torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]
BUILT_IN = ("grpo",)


def resolve_loss(where: str, loss_fn: ExtrasLoss | str | None, grpo: GrpoLoss) -> ExtrasLoss | GrpoLoss | None:
    """A per-call loss: a callable `(output, targets, extras) -> sum`, or a built-in's name."""
    if loss_fn is None or callable(loss_fn):
        return loss_fn
    if loss_fn == "grpo":
        return grpo
    raise ConfigError(f"{where}: loss_fn = {loss_fn!r} is unknown; use one of {', '.join(BUILT_IN)} or a callable")


def check_extras(
    where: str, extras: Any, loss: ExtrasLoss | GrpoLoss | None, batch: int, seq: int | None
) -> dict[str, torch.Tensor]:
    """The extras as a dict of tensors with leading dims [B] or [B, S] of this DP rank's batch, the keys the loss
    needs among them; one ConfigError line otherwise (every rank checks the same, before any collective)."""
    if extras is None:
        extras = {}
    if not isinstance(extras, Mapping):
        raise ConfigError(f"{where}: extras must be a dict of tensors, got {type(extras).__name__}")
    if extras and loss is None:
        raise ConfigError(f"{where}: extras need a loss reading them; pass loss_fn=(output, targets, extras) or 'grpo'")
    for key, t in extras.items():
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"{where}: extras[{key!r}] is a {type(t).__name__}, not a tensor; pass a torch.Tensor")
        per_token = isinstance(loss, GrpoLoss) and key in loss.per_token
        ok = t.dim() >= 1 and t.shape[0] == batch and (t.dim() == 1 and not per_token or t.shape[1:2] == (seq,))
        if not ok:
            want = f"[{batch}, {seq}]" if per_token else f"[{batch}] or [{batch}, {seq}, ...]"
            raise ConfigError(f"{where}: extras[{key!r}] has shape {tuple(t.shape)}; it must lead with {want}")
    missing = [k for k in getattr(loss, "needs", ()) if k not in extras]
    if missing:
        raise ConfigError(f"{where}: loss_fn 'grpo' needs extras[{missing[0]!r}]; pass it ([batch] or [batch, seq])")
    return dict(extras)


def per_call(
    where: str, inputs: torch.Tensor, extras: Any, loss_fn: ExtrasLoss | str | None, options: Any
) -> tuple[ExtrasLoss | GrpoLoss | None, dict[str, torch.Tensor]]:
    """A step's own loss (GRPO's clip and KL coefficient from the build options) and its checked extras."""
    loss = resolve_loss(where, loss_fn, GrpoLoss(options.grpo_clip, options.grpo_kl_coef))
    seq = inputs.shape[1] if inputs.dim() > 1 else None
    return loss, check_extras(where, extras, loss, inputs.shape[0], seq)


def shard_extras(extras: dict[str, torch.Tensor], cp: ContextParallel | None, device) -> dict[str, torch.Tensor]:
    """Per-token extras cut like the labels under context parallel (this cp rank's head-tail chunks), on the device."""
    if cp is None:
        return {k: t.to(device) for k, t in extras.items()}
    return {k: (cp.shard(t) if t.dim() > 1 else t).to(device) for k, t in extras.items()}


class RowLoss:
    """The schedule's loss_fn: the pipeline's own loss (`inner`), or for one call (`route`, `collect`) a loss over the
    microbatch's rows, whose indices arrive as the target."""

    def __init__(self, inner: Any):
        self.inner = inner
        self._rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.inner(output, target) if self._rows is None else self._rows(output, target)

    @contextlib.contextmanager
    def _routing(self, fn: Callable, labels: torch.Tensor | None) -> Iterator[torch.Tensor | None]:
        if labels is None:  # a rank without the last stage: nothing to route
            yield None
            return
        self._rows = fn
        try:
            yield torch.arange(labels.shape[0], device=labels.device)
        finally:
            self._rows = None

    def route(
        self, loss: ExtrasLoss | GrpoLoss | None, labels: torch.Tensor | None, extras: dict[str, torch.Tensor]
    ) -> contextlib.AbstractContextManager:
        """For one step: the microbatch's `loss(output, labels, extras)` sum times the pipeline's scale (global
        normalizer, FSDP mean undone); the `with` value is the target to hand the schedule. Without `loss`, as is."""
        if loss is None:
            return contextlib.nullcontext(labels)
        tp_mesh = getattr(self.inner, "tp_mesh", None)

        def rows_loss(output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            ex = {k: t[rows] for k, t in extras.items()}
            if isinstance(loss, GrpoLoss):
                total = loss.on_logits(output, labels[rows], ex, tp_mesh)
            else:  # the caller's: the vocab shard as a DTensor under loss_parallel, as the token loss sees it
                total = loss(vocab_parallel(output, tp_mesh), labels[rows], ex)
                total = total.full_tensor() if hasattr(total, "full_tensor") else total
            return scaled(total, self.inner.scale)  # the scale may be a device tensor (no host read)

        return self._routing(rows_loss, labels)

    def collect(self, out: torch.Tensor, labels: torch.Tensor | None) -> contextlib.AbstractContextManager:
        """For one forward-only pass: each microbatch's token log-probs written into `out`'s rows."""
        tp_mesh = getattr(self.inner, "tp_mesh", None)

        def rows_logprobs(output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            out[rows] = token_logprobs(output, labels[rows], tp_mesh)
            return out.new_zeros(())

        return self._routing(rows_logprobs, labels)
