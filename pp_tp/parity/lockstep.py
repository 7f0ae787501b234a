"""The same optimizer steps on a model in one process and on its Pipeline, judged after every step against a
float64 run of the plain model: the loss, every full gradient, every parameter after the optimizer step, the
persistent buffers and the clipped norm.

Why float64: a fixed tolerance on fp32 differences is bound to one machine (kernels round differently on another
CPU) and to how well conditioned each tensor is. So the loss, every gradient, every persistent buffer and the
clipped norm of the pipelined build are judged by their distance to the float64 truth relative to the plain fp32
build's own distance, per tensor: each passes when
    err(pipeline, f64) <= FACTOR * err(plain fp32, f64) + floor,
`floor` being a few units of roundoff of the pipeline's compute dtype (fp32, or bf16 under mixed precision).
Every step is judged from the pipeline's own parameters: AdamW scales every element's update to about lr, so a
gradient element near its eps whose roundoff differs (measured on CREDIT: 4.4e-9, off by 2 %) moves that parameter
by up to lr in either fp32 build, at random, and two trajectories part by more than any factor allows from then on.
So the first step starts all three builds from the model's weights (the pipeline's loaded parameters must equal
them), each later step loads the pipeline's current parameters into both references first, and the parameters after
each optimizer step are judged against that step redone in float64 from the pipeline's own parameters and
gradients (within the floor). Gradients right and the step right: the parameters are right.

`pp-tp parity` (pp_tp/cli/parity.py) and the parity tests (tests/parity_utils.py) share it, so the command checks
what the tests check. Each rank runs the pipeline on its DP share; each reference runs on the whole batch on one
rank and is mirrored on the others (pp_tp/parity/shared.py), or on every rank with `shared=False`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.base.forward import without_cache
from pp_tp.base.tensors import persistent_buffers
from pp_tp.parallel.grads import clip_grad_norm_
from pp_tp.parallel.mesh import dp_rank, dp_size, rank_device
from pp_tp.parity.assembled import Assembled, Key
from pp_tp.parity.shared import load_on, owners, step_on
from pp_tp.parity.widen import Float64Throughout
from pp_tp.runtime.loss import SumLoss, target_count
from pp_tp.runtime.pipeline import Pipeline

MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

# The pipeline may sit this many times further from the truth than the plain fp32 build: it sums the same terms in
# another order (microbatches, TP and DP reductions), which moves roundoff by a small factor, never by a bug's size.
FACTOR = 10.0
# Units of roundoff of the compute dtype that any tensor may be off, even where the plain build happens to be exact.
FLOOR_ULPS = 8


def floor_for(dtype: torch.dtype) -> float:
    """The error every tensor is allowed whatever the plain build's: FLOOR_ULPS units of `dtype`'s roundoff."""
    return FLOOR_ULPS * torch.finfo(dtype).eps


def mean_token_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's own forward and the mean cross-entropy over non-ignored labels: what `Pipeline.step` equals."""
    out = model(ids, **without_cache(model))
    logits = out.logits if hasattr(out, "logits") else out
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays float64
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def dp_share(mesh: DeviceMesh, t: torch.Tensor) -> torch.Tensor:
    """This DP rank's contiguous rows of a global batch (the trainer's loader cuts it the same way)."""
    per = t.shape[0] // dp_size(mesh)
    start = dp_rank(mesh) * per
    return t[start : start + per]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


# The plain computation a pipeline must equal, for a batch (ids, labels, *extra): e.g. each packed document alone.
LossOf = Callable[..., torch.Tensor]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype, widen: bool) -> Iterator[None]:
    """float64 as torch's default dtype while a float64 model runs: tensors its own code makes without a dtype
    (XGLM's mask fill) are then float64 too, as the truth needs; with `widen`, so are those it asks in fp32
    (pp_tp/parity/widen.py)."""
    if dtype != torch.float64:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with Float64Throughout() if widen else contextlib.nullcontext():
            yield
    finally:
        torch.set_default_dtype(before)


class ReferenceRun:
    """The model in one process: each step zero_grad, mean token loss (or `loss`'s sum over its normalizer, or
    `loss_of(model, ids, labels, *extra)`) on the whole batch, backward, clip (with `max_norm`, torch's
    clip_grad_norm_), optimizer step. A float64 model runs float64 throughout (`widen`): the casts to fp32 its own
    code makes (transformers' norms, rotary tables, gated-delta-net gates) are float64 too, else the truth would carry
    the same fp32 roundoff as the plain fp32 build it judges and measure its distance too small (issue 48)."""

    widen = True

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: MakeOptimizer,
        max_norm: float | None = None,
        loss: SumLoss | None = None,
        loss_of: LossOf | None = None,
    ):
        self.model, self.max_norm, self.loss, self.loss_of = model, max_norm, loss, loss_of
        self.make_optimizer = make_optimizer
        self.optimizer = make_optimizer(list(model.parameters()))
        self.losses: list[float] = []
        self.norms: list[float] = []

    def in_float64(self) -> ReferenceRun:
        """The same run on a float64 copy of the model as it is now (before any step): the truth both fp32 builds
        are judged against. Integer buffers stay as they are."""
        if self.losses:
            raise RuntimeError("the float64 truth must start from the weights before the first step")
        model = copy.deepcopy(self.model).to(torch.float64)
        if hasattr(model, "set_experts_implementation"):  # a transformers model (a no-op for one without experts)
            model.set_experts_implementation("eager")  # transformers' grouped_mm experts refuse float64
        return ReferenceRun(model, self.make_optimizer, self.max_norm, self.loss, self.loss_of)

    def step(self, ids: torch.Tensor, labels: torch.Tensor, *extra: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        param = next(self.model.parameters())
        ids, labels, *extra = (
            t.to(param.device, param.dtype if t.is_floating_point() else t.dtype) for t in (ids, labels, *extra)
        )
        with _default_dtype(param.dtype, self.widen):
            if self.loss_of is not None:
                loss = self.loss_of(self.model, ids, labels, *extra)
            elif self.loss is None:
                loss = mean_token_loss(self.model, ids, labels)
            else:
                loss = self.loss.fn(self.model(ids), labels) / target_count(labels, self.loss.normalizer)
            loss.backward()
        if self.max_norm is not None:
            self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)))
        self.optimizer.step()
        self.losses.append(loss.item())
        return self.losses[-1]

    def load(self, params: dict[str, torch.Tensor]) -> None:
        """Sets every parameter (canonical names) to `params`' value, cast to the model's dtype."""
        with torch.no_grad():
            for k, p in self.model.named_parameters():
                p.copy_(params[k])

    def grads(self) -> dict[str, torch.Tensor]:
        """Gradients by canonical name (a tied weight once)."""
        return {k: p.grad for k, p in self.model.named_parameters()}

    def params(self) -> dict[str, torch.Tensor]:
        return {k: p.detach() for k, p in self.model.named_parameters()}

    def buffers(self) -> dict[str, torch.Tensor]:
        return persistent_buffers(self.model)


class PipelineRun:
    """The pipelined build: the same steps, each rank on its DP share, clipping with pp_tp's clip_grad_norm_.
    `grads` and `params` are whole values (assembled where TP or FSDP shard them, pp_tp/parity/assembled.py) under
    the stages' local names; `keys` maps those to the model's canonical names (a tied copy to its weight)."""

    def __init__(self, pipe: Pipeline, make_optimizer: MakeOptimizer, max_norm: float | None = None):
        self.pipe, self.max_norm, self.make_optimizer = pipe, max_norm, make_optimizer
        self.optimizer = make_optimizer([p for part in pipe.model_parts for p in part.parameters()])
        self.keys = {k: part.checkpoint_keys[k] for part in pipe.model_parts for k, _ in part.named_parameters()}
        self.losses: list[float] = []
        self.norms: list[float] = []
        self._assembled: Assembled | None = None

    @property
    def floor(self) -> float:
        """The error floor of this build's compute dtype (bf16 under mixed precision, else fp32)."""
        return floor_for(torch.bfloat16 if self.pipe.pcfg.mixed_precision == "bf16" else torch.float32)

    def step(self, ids: torch.Tensor, labels: torch.Tensor, *extra: torch.Tensor) -> float:
        """`extra`: more per-row inputs `Pipeline.step` takes (position ids of packed documents)."""
        self.optimizer.zero_grad()
        loss = float(self.pipe.step(*(dp_share(self.pipe.mesh, t) for t in (ids, labels, *extra))))
        if self.max_norm is not None:
            self.norms.append(float(clip_grad_norm_(self.pipe.model_parts, self.max_norm, self.pipe.mesh)))
        self.optimizer.step()
        self.losses.append(loss)
        return loss

    def _named(self) -> dict[str, nn.Parameter]:
        return {k: p for part in self.pipe.model_parts for k, p in part.named_parameters()}

    @property
    def assembled(self) -> Assembled:
        """Laid out on first use: a collective over the world, which the pipeline's mesh must cover."""
        if self._assembled is None:
            mesh = self.pipe.mesh
            if mesh.size() != dist.get_world_size():
                raise ValueError(f"parity judges a pipeline on the whole world: its mesh has {mesh.size()} ranks")
            self._assembled = Assembled(self._named(), self.keys, mesh.get_local_rank("pp"), rank_device(mesh))
        return self._assembled

    def grads(self) -> dict[str, torch.Tensor]:
        return self.assembled.own(self.assembled.every({k: p.grad for k, p in self._named().items()}))

    def every_param(self) -> dict[Key, torch.Tensor]:
        """Every pp rank's whole parameters, by (pp rank, local name)."""
        return self.assembled.every(self._named())

    def params(self) -> dict[str, torch.Tensor]:
        return self.assembled.own(self.every_param())

    def buffers(self) -> dict[str, torch.Tensor]:
        return {k: b for part in self.pipe.model_parts for k, b in persistent_buffers(part).items()}


def worst_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], keys: dict[str, str]) -> float:
    """The largest relative error of `got`'s tensors against `want`'s, looked up under `keys` (canonical names)."""
    return max((tensor_err(t, want[keys[k]]) for k, t in got.items()), default=0.0)


def buffer_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Worst relative error of a stage's persistent buffers against the reference model's (inf for a missing or
    extra one, or a mismatched integer buffer)."""
    return max((tensor_err(b, want.get(k)) for k, b in got.items()), default=0.0)


def tensor_err(got: torch.Tensor, want: torch.Tensor | None) -> float:
    """Relative error; inf where `want` is missing or shaped otherwise, or an integer tensor differs at all. A
    parameter no gradient reaches (None: DeepSeek-V3.2's indexer, read only through its top-k) matches only None."""
    if got is None or want is None:
        return 0.0 if got is None and want is None else float("inf")
    if got.shape != want.shape:
        return float("inf")
    if not got.is_floating_point():
        return 0.0 if torch.equal(got, want.to(got.dtype)) else float("inf")
    return rel_err(got, want)


@dataclass(frozen=True)
class Judged:
    """One kind of tensor (grads, params, ...) on this rank against the float64 truth: the worst per-tensor score
    err_pipe / (FACTOR * err_plain + floor), the tensor that has it, and its two distances."""

    score: float = 0.0
    name: str = ""
    pipe: float = 0.0
    plain: float = 0.0

    @property
    def passed(self) -> bool:
        """Within FACTOR x the plain build's distance plus the floor (a NaN score fails)."""
        return self.score <= 1.0


def judge(
    got: dict[str, torch.Tensor],
    plain: dict[str, torch.Tensor] | None,
    truth: dict[str, torch.Tensor],
    keys: dict[str, str],
    floor: float,
) -> Judged:
    """Each of `got`'s tensors (under `keys`' canonical names) scored against the truth; passes at score <= 1. A
    tensor the references lack, or shaped otherwise, scores inf; without `plain`, the floor alone bounds it."""
    worst = Judged()
    for k, t in got.items():
        name = keys.get(k, k)
        e_pipe = tensor_err(t, truth.get(name))
        if plain is None:  # no plain build to measure the conditioning: the floor alone
            e_plain = 0.0
        else:
            e_plain = tensor_err(plain[name], truth[name]) if name in plain and name in truth else float("inf")
        score = e_pipe / (FACTOR * e_plain + floor) if max(e_pipe, e_plain) < float("inf") else float("inf")
        if score > worst.score or not worst.name:
            worst = Judged(score, name, e_pipe, e_plain)
    return worst


def _judge_scalar(got: list[float], plain: list[float], truth: list[float], floor: float) -> Judged:
    """The last value of a per-step series (loss, clipped norm) judged like a tensor."""
    return judge(*({"x": torch.tensor(v[-1], dtype=torch.float64)} for v in (got, plain, truth)), {}, floor)


@dataclass(frozen=True)
class StepDiff:
    """One step of the three runs: the global losses; this rank's worst relative errors against the plain fp32 build
    (its own parameters); and `judged`, per kind (loss, grads, params, buffers, norm), the verdict against the
    float64 truth that decides `passed`."""

    loss: float
    ref_loss: float
    truth_loss: float
    loss_err: float
    grad_err: float
    param_err: float
    buffer_err: float
    judged: dict[str, Judged]

    @property
    def score(self) -> float:
        return max(j.score for j in self.judged.values())

    @property
    def passed(self) -> bool:
        return all(j.passed for j in self.judged.values())


class StepInFloat64:
    """The pipeline's optimizer steps redone in float64 on full copies of its parameters, from its own parameters
    and (clipped) gradients each step, with an optimizer of the same factory carrying its own state."""

    def __init__(self, make_optimizer: MakeOptimizer, params: dict[str, torch.Tensor]):
        self.params = {k: nn.Parameter(p.double()) for k, p in params.items()}
        self.optimizer = make_optimizer(list(self.params.values()))

    def take(self, before: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The parameters one step after `before` with `grads`."""
        with torch.no_grad():
            for k, p in self.params.items():
                p.copy_(before[k])
                p.grad = None if grads[k] is None else grads[k].double()
        self.optimizer.step()
        return {k: p.detach() for k, p in self.params.items()}


@dataclass(frozen=True)
class _Gathered:
    """The pipeline's whole gradients, parameters and buffers after a step, assembled once (a collective) for every
    comparison of that step."""

    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def _judge_step(
    run: PipelineRun, got: _Gathered, ref: ReferenceRun, truth: ReferenceRun, update: dict[str, torch.Tensor]
) -> dict[str, Judged]:
    """Every kind of tensor of the step just taken, judged against the truth; parameters against `update`."""
    floor, keys = run.floor, run.keys
    out = {"loss": _judge_scalar(run.losses, ref.losses, truth.losses, floor)}
    if run.norms:
        out["norm"] = _judge_scalar(run.norms, ref.norms, truth.norms, floor)
    out["grads"] = judge(got.grads, ref.grads(), truth.grads(), keys, floor)
    out["params"] = judge(got.params, None, update, {}, floor)
    out["buffers"] = judge(got.buffers, ref.buffers(), truth.buffers(), {}, floor)
    return out


def lockstep(
    run: PipelineRun, ref: ReferenceRun, batches: Iterable[tuple[torch.Tensor, ...]], shared: bool = True
) -> Iterator[StepDiff]:
    """Steps the pipeline, the plain fp32 build and its float64 copy (made here, before the first step) on each
    global batch (ids, labels, *extra) and judges them after each step. `shared`: each reference steps on one rank
    and is mirrored on the others (pp_tp/parity/shared.py); False for a caller that reads a reference model's
    optimizer state or non-persistent buffers afterwards."""
    every = run.every_param()  # new tensors, not views of the live parameters: the optimizer steps leave them be
    params = run.assembled.own(every)
    truth, redo = ref.in_float64(), StepInFloat64(run.make_optimizer, params)
    mine, true_owner = owners(shared)
    loaded = judge(params, None, ref.params(), run.keys, run.floor)  # the pipeline holds the model's weights
    for i, batch in enumerate(batches):
        before = params
        if i:  # from the pipeline's parameters (module docstring: fp32 trajectories part at random)
            state = {k: p.cpu() for k, p in run.assembled.canonical(every).items()}
            load_on(mine, ref, state)
            load_on(true_owner, truth, state)
        got = run.step(*batch)
        step_on(((mine, ref), (true_owner, truth)), batch)
        want, true = ref.losses[-1], truth.losses[-1]
        every = run.every_param()
        params = run.assembled.own(every)
        after = _Gathered(run.grads(), params, run.buffers())
        judged = _judge_step(run, after, ref, truth, redo.take(before, after.grads))
        if not i:
            judged["params"] = max(judged["params"], loaded, key=lambda j: j.score)
        yield StepDiff(
            loss=got,
            ref_loss=want,
            truth_loss=true,
            loss_err=abs(got - want) / max(abs(want), 1e-30),
            grad_err=worst_err(after.grads, ref.grads(), run.keys),
            param_err=worst_err(after.params, ref.params(), run.keys),
            buffer_err=buffer_err(after.buffers, ref.buffers()),
            judged=judged,
        )
