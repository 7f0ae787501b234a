"""`pp-tp parity`: the user's own config against its non-PP build, for a few steps, before a long job.

Every rank builds the single-process model on the same weights and batch (so the model must fit on
one device), runs the same AdamW steps, and compares after each step the loss, every local parameter's full
gradient and updated value, and the persistent buffers with the pipelined build (pp_tp/parity.py). Dropout is off
in both builds (their masks differ by design) and the output says so. Rank 0 prints one row per step; the exit
code says whether all rows passed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

import pp_tp
from pp_tp.cli.job import add_job_args, load_job
from pp_tp.config import JobConfig
from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.mesh import init_distributed
from pp_tp.models.factory import build_model
from pp_tp.parallel.rng import switch_off_dropout
from pp_tp.parity import PipelineRun, ReferenceRun, lockstep
from pp_tp.runtime.loss import SumLoss
from pp_tp.seeded_init import init_weights
from pp_tp.train.sources import make_source

DEFAULT_TOL = {"fp32": 1e-4, "bf16": 5e-2}


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


def run_parity(cfg: JobConfig, steps: int, tol: float | None) -> int:
    """Per-rank work; returns 0 when every step's loss, gradients, parameters and buffers are within `tol` on every
    rank (pp_tp/parity.py compares them)."""
    tol = DEFAULT_TOL[cfg.parallel.mixed_precision] if tol is None else tol
    init_distributed(cfg.training.comm_timeout_s)
    mesh = pp_tp.build_mesh(cfg.parallel)
    model, meta = build_model(cfg.model, "cpu"), build_model(cfg.model, "meta")
    dropout = switch_off_dropout(model)  # two builds draw different masks: compare without them (said below)
    switch_off_dropout(meta)
    layout = layout_for(model)
    init_weights(model, cfg.model.seed, layout.dims(model).n_layers, layout.init_std)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    t = cfg.training
    pipe = pp_tp.build_pipeline(meta, mesh, cfg.parallel, state_dict=state, loss_fn=t.loss or None)

    def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)

    loss = SumLoss(t.loss) if t.loss else None
    run, ref = PipelineRun(pipe, adamw), ReferenceRun(model.to(pipe.device), adamw, loss=loss)
    rows, ok = [], True
    for step, d in enumerate(lockstep(run, ref, parity_batches(cfg, steps)), start=1):
        worst = torch.tensor([d.grad_err, d.param_err, d.buffer_err], dtype=torch.float64, device=pipe.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # each rank compared only its own parameters
        errs = [d.loss_err, *worst.tolist()]
        passed = max(errs) <= tol
        ok &= passed
        rows.append((step, d.loss, d.ref_loss, *errs, "ok" if passed else "FAIL"))
    if dist.get_rank() == 0:
        print(format_table(rows, tol))
        if dropout:
            print(f"dropout off in both builds for the comparison: {', '.join(dropout)}")
    return 0 if ok else 1


def format_table(rows: list[tuple], tol: float) -> str:
    """One line per step: both losses, then the worst relative errors of loss, gradients, parameters, buffers."""
    head = (
        f"{'step':>4}  {'loss (pipelined)':>16}  {'loss (non-PP)':>14}  {'rel diff':>9}  {'worst grad err':>14}  "
        f"{'worst param err':>15}  {'buffer err':>10}"
    )
    lines = [head] + [
        f"{s:>4}  {a:>16.6f}  {b:>14.6f}  {d:>9.2e}  {g:>14.2e}  {p:>15.2e}  {u:>10.2e}  {v}"
        for s, a, b, d, g, p, u, v in rows
    ]
    return "\n".join(lines + [f"tolerance {tol:.0e} (relative)"])


def main(argv: list[str] | None = None) -> int:
    """Per-rank entry under torchrun: `python -m pp_tp.cli.parity --config F [--steps N] [overrides]`."""
    parser = argparse.ArgumentParser(prog="pp_tp.cli.parity")
    add_parity_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_parity(load_job(args), args.steps, args.tol)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def add_parity_args(parser: argparse.ArgumentParser) -> None:
    add_job_args(parser)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps to compare")
    parser.add_argument(
        "--tol", type=float, default=None, help="relative tolerance (default 1e-4 for fp32, 5e-2 for bf16)"
    )


if __name__ == "__main__":
    sys.exit(main())
