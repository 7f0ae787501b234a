"""`pp-tp parity`: the user's own config against its non-PP build, for a few steps, before a long job.

Every rank builds the single-process model on the same weights and batch (so the model must fit on
one device), runs the same AdamW steps, and compares loss and every local parameter's full gradient
with the pipelined build. Rank 0 prints one row per step; the exit code says whether all rows passed.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pp_tp
from pp_tp.cli.job import add_job_args, load_job
from pp_tp.config import JobConfig
from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.mesh import init_distributed
from pp_tp.models.factory import build_model
from pp_tp.seeded_init import init_weights
from pp_tp.tensor_utils import full_tensor

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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


def run_parity(cfg: JobConfig, steps: int, tol: float | None) -> int:
    """Per-rank work; returns 0 when every step's loss and gradients are within `tol` on every rank."""
    tol = DEFAULT_TOL[cfg.parallel.mixed_precision] if tol is None else tol
    init_distributed(cfg.training.comm_timeout_s)
    mesh = pp_tp.build_mesh(cfg.parallel)
    ref = build_model(cfg.model, "cpu")
    layout = layout_for(ref)
    init_weights(ref, cfg.model.seed, layout.dims(ref).n_layers, layout.init_std)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    pipe = pp_tp.build_pipeline(build_model(cfg.model, "meta"), mesh, cfg.parallel, state_dict=state)
    device = pipe.device
    ref = ref.to(device)
    t = cfg.training
    make_opt = lambda params: torch.optim.AdamW(
        params,
        lr=t.lr,
        betas=(t.beta1, t.beta2),  # noqa: E731
        weight_decay=t.weight_decay,
    )
    ref_opt = make_opt(ref.parameters())
    opt = make_opt([p for part in pipe.model_parts for p in part.parameters()])
    dp_rank = mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size() + mesh["dp_shard"].get_local_rank()
    per = t.batch_size // cfg.parallel.dp
    rows, ok = [], True
    for step in range(1, steps + 1):
        ids, labels = synthetic_batch(cfg, step)
        ref_opt.zero_grad()
        out = ref(ids.to(device))
        logits = out.logits if hasattr(out, "logits") else out
        ref_loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.to(device).flatten(), ignore_index=-100)
        ref_loss.backward()
        opt.zero_grad()
        loss = pipe.step(ids[dp_rank * per : (dp_rank + 1) * per], labels[dp_rank * per : (dp_rank + 1) * per])
        ref_grads = dict(ref.named_parameters())
        worst = max(
            _rel(full_tensor(p.grad), ref_grads[k].grad)
            for part in pipe.model_parts
            for k, p in part.named_parameters()
        )
        worst_t = torch.tensor([worst], dtype=torch.float64, device=device)
        dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
        loss_diff = abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-30)
        passed = loss_diff <= tol and worst_t.item() <= tol
        ok &= passed
        rows.append((step, loss.item(), ref_loss.item(), loss_diff, worst_t.item(), "ok" if passed else "FAIL"))
        ref_opt.step()
        opt.step()
    if dist.get_rank() == 0:
        print(format_table(rows, tol))
    return 0 if ok else 1


def format_table(rows: list[tuple], tol: float) -> str:
    head = f"{'step':>4}  {'loss (pipelined)':>16}  {'loss (non-PP)':>14}  {'rel diff':>9}  {'worst grad err':>14}"
    lines = [head] + [f"{s:>4}  {a:>16.6f}  {b:>14.6f}  {d:>9.2e}  {g:>14.2e}  {v}" for s, a, b, d, g, v in rows]
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
