"""The same optimizer steps on a model in one process and on its Pipeline, compared after every step: the loss,
every full gradient, every parameter after the optimizer step and the persistent buffers.

`pp-tp parity` (pp_tp/cli/parity.py) and the parity tests (tests/parity_utils.py) share it, so the command checks
what the tests check. Each rank runs both: the reference on the whole batch, the pipeline on its DP share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.mesh import dp_rank, dp_size
from pp_tp.parallel.grads import clip_grad_norm_
from pp_tp.runtime.loss import SumLoss, target_count
from pp_tp.runtime.pipeline import Pipeline
from pp_tp.tensor_utils import full_tensor, persistent_buffers

MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def mean_token_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's own forward and the mean cross-entropy over non-ignored labels: what `Pipeline.step` equals."""
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def dp_share(mesh: DeviceMesh, t: torch.Tensor) -> torch.Tensor:
    """This DP rank's contiguous rows of a global batch (the trainer's loader cuts it the same way)."""
    per = t.shape[0] // dp_size(mesh)
    start = dp_rank(mesh) * per
    return t[start : start + per]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


class ReferenceRun:
    """The model in one process: each step zero_grad, mean token loss (or `loss`'s sum over its normalizer) on the
    whole batch, backward, clip (with `max_norm`, torch's clip_grad_norm_), optimizer step."""

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: MakeOptimizer,
        max_norm: float | None = None,
        loss: SumLoss | None = None,
    ):
        self.model, self.max_norm, self.loss = model, max_norm, loss
        self.optimizer = make_optimizer(list(model.parameters()))
        self.losses: list[float] = []
        self.norms: list[float] = []

    def step(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        device = next(self.model.parameters()).device
        ids, labels = ids.to(device), labels.to(device)
        if self.loss is None:
            loss = mean_token_loss(self.model, ids, labels)
        else:
            loss = self.loss.fn(self.model(ids), labels) / target_count(labels, self.loss.normalizer)
        loss.backward()
        if self.max_norm is not None:
            self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)))
        self.optimizer.step()
        self.losses.append(loss.item())
        return self.losses[-1]

    def grads(self) -> dict[str, torch.Tensor]:
        """Gradients by canonical name (a tied weight once)."""
        return {k: p.grad for k, p in self.model.named_parameters()}

    def params(self) -> dict[str, torch.Tensor]:
        return {k: p.detach() for k, p in self.model.named_parameters()}

    def buffers(self) -> dict[str, torch.Tensor]:
        return persistent_buffers(self.model)


class PipelineRun:
    """The pipelined build: the same steps, each rank on its DP share, clipping with pp_tp's clip_grad_norm_.
    `grads` and `params` are full values (gathered where TP or FSDP shard them) under the stages' local names;
    `keys` maps those to the model's canonical names (a tied copy to its weight)."""

    def __init__(self, pipe: Pipeline, make_optimizer: MakeOptimizer, max_norm: float | None = None):
        self.pipe, self.max_norm = pipe, max_norm
        self.optimizer = make_optimizer([p for part in pipe.model_parts for p in part.parameters()])
        self.keys = {k: part.checkpoint_keys[k] for part in pipe.model_parts for k, _ in part.named_parameters()}
        self.losses: list[float] = []
        self.norms: list[float] = []

    def step(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = float(self.pipe.step(dp_share(self.pipe.mesh, ids), dp_share(self.pipe.mesh, labels)))
        if self.max_norm is not None:
            self.norms.append(float(clip_grad_norm_(self.pipe.model_parts, self.max_norm, self.pipe.mesh)))
        self.optimizer.step()
        self.losses.append(loss)
        return loss

    def grads(self) -> dict[str, torch.Tensor]:
        return {k: full_tensor(p.grad) for part in self.pipe.model_parts for k, p in part.named_parameters()}

    def params(self) -> dict[str, torch.Tensor]:
        return {k: full_tensor(p).detach() for part in self.pipe.model_parts for k, p in part.named_parameters()}

    def buffers(self) -> dict[str, torch.Tensor]:
        return {k: b for part in self.pipe.model_parts for k, b in persistent_buffers(part).items()}


def worst_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], keys: dict[str, str]) -> float:
    """The largest relative error of `got`'s tensors against `want`'s, looked up under `keys` (canonical names)."""
    return max((rel_err(t, want[keys[k]]) for k, t in got.items()), default=0.0)


def buffer_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Worst relative error of a stage's persistent buffers against the reference model's (inf for a missing or
    extra one, or a mismatched integer buffer)."""
    errs = [0.0]
    for k, b in got.items():
        if k not in want or b.shape != want[k].shape:
            return float("inf")
        same = torch.equal(b, want[k])
        errs.append(rel_err(b, want[k]) if b.is_floating_point() else (0.0 if same else float("inf")))
    return max(errs)


@dataclass(frozen=True)
class StepDiff:
    """One step of both runs: the global losses, and this rank's worst relative errors (its own parameters)."""

    loss: float
    ref_loss: float
    loss_err: float
    grad_err: float
    param_err: float
    buffer_err: float


def lockstep(
    run: PipelineRun, ref: ReferenceRun, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
) -> Iterator[StepDiff]:
    """Steps both runs on each global batch and compares them after each step."""
    for ids, labels in batches:
        want, got = ref.step(ids, labels), run.step(ids, labels)
        yield StepDiff(
            loss=got,
            ref_loss=want,
            loss_err=abs(got - want) / max(abs(want), 1e-30),
            grad_err=worst_err(run.grads(), ref.grads(), run.keys),
            param_err=worst_err(run.params(), ref.params(), run.keys),
            buffer_err=buffer_err(run.buffers(), ref.buffers()),
        )
