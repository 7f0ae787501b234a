"""`pp-tp parity`: the user's own config against its non-PP build, for a few steps, before a long job.

Every rank builds the single-process model on the same weights and batch, in fp32 and in float64 (so the model must
fit on one device twice over); one rank steps each of them with the job's own AdamW and clipping and the others mirror
its results (pp_tp/parity/shared.py). Every rank judges after each step the loss, every local parameter's full
gradient and updated value, the persistent buffers and the clipped norm of the pipelined build by their distance to
the float64 truth next to the plain fp32 build's (pp_tp/parity/lockstep.py). Dropout is off in all builds (their
masks differ by design) and the output says so. Rank 0 prints one row per step with both distances; the exit code
says whether all rows passed.

`--float64` (parallel.dtype = "float64"): the pipelined build itself in float64 against the plain model in float64,
per tensor within pp_tp.parity.float64.BOUND, no fp32 run involved (pp_tp/parity/float64.py; what the model's own
code asks in fp32 runs in float64 in both, pp_tp/parity/widen.py); rank 0 prints each step's worst relative error per
kind and the worst tensor of each kind.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import pp_tp
from pp_tp.base.seeded_init import init_weights
from pp_tp.cli.job import add_job_args, load_job
from pp_tp.config import JobConfig
from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.models.factory import build_model
from pp_tp.models.hf.layout import is_hf_model
from pp_tp.models.hf.randomness import noise_keys, switch_off_noise
from pp_tp.parallel.mesh import init_distributed
from pp_tp.parallel.rng import switch_off_dropout
from pp_tp.parity import FACTOR, FLOOR_ULPS, PipelineRun, ReferenceRun, StepDiff, lockstep
from pp_tp.parity.float64 import BOUND, Worst, float64_model, lockstep_float64
from pp_tp.runtime.loss import SumLoss
from pp_tp.train.sources import make_source

KINDS = ("loss", "grads", "params", "buffers")


def synthetic_batch(cfg: JobConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: random ids, next-token labels, and uneven padding per row."""
    t = cfg.training
    gen = torch.Generator().manual_seed(cfg.training.seed * 1000 + step)
    ids = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), generator=gen)
    labels = ids[:, 1:].clone()
    for row in range(t.batch_size):
        labels[row, t.seq_len - (row * 7) % max(t.seq_len // 2, 1) :] = -100
    return ids[:, :-1].contiguous(), labels


def parity_batches(cfg: JobConfig, steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches compared: random padded tokens for a language model; with `[training] loss` (a model that
    is not an LM) the job's own data source, whose inputs and targets a token batch could not stand in for."""
    if not cfg.training.loss:
        return (synthetic_batch(cfg, step) for step in range(1, steps + 1))
    loader = make_source(cfg).loader(0, 1)
    return (loader.next()[:2] for _ in range(steps))


def run_parity(cfg: JobConfig, steps: int, mesh: DeviceMesh | None = None) -> int:
    """Per-rank work; returns 0 when every step's loss, gradients, parameters, buffers (and clipped norm) pass the
    float64 verdict on every rank (pp_tp/parity/lockstep.py judges them). The optimizer is the job's: AdamW with its lr,
    betas and weight decay (torch's eps), clipping at `training.max_norm`. `mesh`: one of `cfg.parallel`'s shape the
    caller already holds (tests running many configs reuse theirs); None builds it, as the CLI does."""
    init_distributed(cfg.training.comm_timeout_s)
    mesh = pp_tp.build_mesh(cfg.parallel) if mesh is None else mesh
    model, meta = build_model(cfg.model, "cpu"), build_model(cfg.model, "meta")
    dropout = switch_off_dropout(model)  # two builds draw different masks: compare without them (said below)
    switch_off_dropout(meta)
    layout = layout_for(model)
    init_weights(model, cfg.model.seed, layout.dims(model).n_layers, layout.init_std)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    float64 = cfg.parallel.dtype == "float64"
    if float64:  # transformers' grouped_mm experts refuse float64: their eager loop in both builds
        if hasattr(meta, "set_experts_implementation"):
            meta.set_experts_implementation("eager")
        float64_model(model, layout)  # build_pipeline turns `meta` float64 itself
    t = cfg.training
    pipe = pp_tp.build_pipeline(meta, mesh, cfg.parallel, state_dict=state, loss_fn=t.loss or None)
    # draws beyond dropout (router jitter): built with them on, so pp_tp's checks see them; compared without them
    noise = noise_keys(model) if is_hf_model(model) else {}
    noise_off = switch_off_noise(model, noise)
    for part in pipe.model_parts:
        switch_off_noise(part, noise)

    def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)

    clip = t.max_norm if t.max_norm > 0 else None
    loss = SumLoss(t.loss) if t.loss else None
    run, ref = PipelineRun(pipe, adamw, clip), ReferenceRun(model.to(pipe.device), adamw, clip, loss=loss)
    if float64:
        return _float64(run, ref, parity_batches(cfg, steps))
    rows = [_row(step, d, pipe.device) for step, d in enumerate(lockstep(run, ref, parity_batches(cfg, steps)), 1)]
    if dist.get_rank() == 0:
        print(format_table(rows))
        if dropout:
            print(f"dropout off in both builds for the comparison: {', '.join(dropout)}")
        if noise_off:
            print(f"random draws beyond dropout off in both builds for the comparison: {', '.join(noise_off)}")
    return 0 if all(r[-1] == "ok" for r in rows) else 1


def _float64(run: PipelineRun, ref: ReferenceRun, batches: Iterator) -> int:
    """The float64 comparison: one row per step (losses, worst relative error per kind over the ranks), then each
    kind's worst tensor; 0 when every tensor is within BOUND."""
    lines = [f"{'step':>4}  {'loss (pipelined)':>20}  {'loss (non-PP)':>20}" + "".join(f"  {k:>9}" for k in KINDS)]
    worst: dict[str, tuple[float, str]] = {k: (0.0, "") for k in KINDS}
    for step, (got, want, kinds) in enumerate(lockstep_float64(run, ref, batches), 1):
        errs = [_worst_over_ranks(kinds[k]) for k in KINDS]
        for k, (err, name) in zip(KINDS, errs):
            if not err <= worst[k][0] or not worst[k][1]:
                worst[k] = (err, f"{name or '(none held)'} (step {step})")
        lines.append(f"{step:>4}  {got:>20.15f}  {want:>20.15f}" + "".join(f"  {e:>9.2e}" for e, _ in errs))
    passed = all(err <= BOUND for err, _ in worst.values())
    if dist.get_rank() == 0:
        lines += [f"worst {k}: {err:.2e} {name}" for k, (err, name) in worst.items()]
        lines.append("both builds float64 throughout: what the model's own code asks in fp32 ran in float64")
        lines.append(
            f"float64 pipeline vs float64 plain model: per tensor max relative error <= {BOUND:g}: "
            + ("ok" if passed else "FAIL")
        )
        print("\n".join(lines))
    return 0 if passed else 1


def _worst_over_ranks(w: Worst) -> tuple[float, str]:
    """The largest error of one kind over the ranks (NaN counts as largest) and its tensor's name."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (w.err, w.name))
    return max(every, key=lambda e: float("inf") if e[0] != e[0] else e[0])


def _row(step: int, d: StepDiff, device: torch.device) -> tuple:
    """One step's figures, each the worst over the ranks (each rank judged only its own parameters)."""
    kinds = [*KINDS, "norm"] if "norm" in d.judged else KINDS
    figures = [x for k in kinds for x in (d.judged[k].pipe, d.judged[k].plain, d.judged[k].score)]
    worst = torch.tensor(figures, dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    w = worst.tolist()
    score = max(w[2::3])
    return (step, d.loss, d.ref_loss, d.truth_loss, *w[: 3 * len(KINDS)], score, "ok" if score <= 1.0 else "FAIL")


def format_table(rows: list[tuple]) -> str:
    """One line per step: the three losses; per kind the worst distances to the float64 truth of the pipelined
    build and of the plain fp32 build (relative); the worst score; the verdict."""
    kinds = "".join(f"  {k + ' pipe/plain':>19}" for k in KINDS)
    head = f"{'step':>4}  {'loss (pipelined)':>16}  {'loss (non-PP)':>14}  {'loss (f64)':>12}{kinds}  {'score':>8}"
    lines = [head]
    for s, a, b, c, *w, score, verdict in rows:
        pairs = "".join(f"  {w[i]:>9.2e}/{w[i + 1]:<9.2e}" for i in range(0, 3 * len(KINDS), 3))
        lines.append(f"{s:>4}  {a:>16.6f}  {b:>14.6f}  {c:>12.6f}{pairs}  {score:>8.3f}  {verdict}")
    rule = (
        f"pass: per tensor, err(pipelined, f64) <= {FACTOR:g} x err(non-PP fp32, f64) + {FLOOR_ULPS} units of the "
        "compute dtype's roundoff (score <= 1)"
    )
    return "\n".join(lines + [rule])


def main(argv: list[str] | None = None) -> int:
    """Per-rank entry under torchrun: `python -m pp_tp.cli.parity --config F [--steps N] [overrides]`."""
    try:
        return run_parity(*parity_job(argv))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def parity_job(argv: list[str] | None) -> tuple[JobConfig, int]:
    """The job and the step count the per-rank arguments name (--float64 as its override), for `run_parity`."""
    parser = argparse.ArgumentParser(prog="pp_tp.cli.parity")
    add_parity_args(parser)
    args = parser.parse_args(argv)
    return load_job(float64_overrides(args)), args.steps


def add_parity_args(parser: argparse.ArgumentParser) -> None:
    add_job_args(parser)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps to compare")
    parser.add_argument(
        "--float64",
        action="store_true",
        help='run the pipelined build in float64 (parallel.dtype = "float64") against the plain model in float64',
    )


def float64_overrides(args: argparse.Namespace) -> argparse.Namespace:
    """--float64 as the override it stands for, so the config checks see it."""
    if args.float64:
        args.overrides = [*args.overrides, "parallel.dtype=float64"]
    return args


def _entry() -> int:
    """The torchrun entry: the process group is ended before exit (as train and export do), so no gloo thread is
    left to the interpreter's teardown; `main` itself leaves it to its caller (tests run it inside their world)."""
    code = main()
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(_entry())
