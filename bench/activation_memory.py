"""Activation memory per pp rank for GPipe, 1F1B and Interleaved1F1B at several m, against the theory.

    python bench/activation_memory.py
    python bench/activation_memory.py --m 2 4 8 16 --pp 2
    python bench/activation_memory.py --cp 1 2 4 --seq 512   # context parallel at one global sequence
    python bench/activation_memory.py --cp 1 2 --seq 2048 --dim 64 --rows 2   # issue 47's run

With --cp: pp2 x cp (2 x cp ranks, 1F1B, m = 2) for each cp at the same global batch and sequence, the step's
peak of saved activations per rank against cp = 1 (the issue's bar: at most 0.55x at cp2, 0.30x at cp4) and
against the dry-run planner's prediction for the same job (pp_tp.planner.plan_job, run in this process).

Measured: the most bytes autograd holds for backward at once during one real step on each rank
(pp_tp.planner.SavedActivations: saved tensors counted live, per storage, parameters excluded).
Theory: one microbatch's saved bytes per local stage, measured by a single forward, times the
microbatches the schedule's action order holds at its peak on that rank (planner.peak_held_bytes):
GPipe holds m, 1F1B holds pp - rank, interleaved as its order says. Counts are bytes, so the numbers
are exact rather than noisy; no timing is involved.
"""

from __future__ import annotations

import argparse

import torch
from common import World, batch, default_stages_per_rank, table, warm_pipeline
from torch import nn

import pp_tp
from pp_tp.config import config_from_dict
from pp_tp.models.reference.model import ModelArgs, Transformer
from pp_tp.planner import SavedActivations, peak_held_bytes, plan_job
from pp_tp.planner.schedule_sim import schedule_actions
from pp_tp.runtime.loss import TokenSumLoss

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


def _one_microbatch_bytes(stage: nn.Module, ids: torch.Tensor, labels: torch.Tensor, dim: int) -> int:
    """Saved bytes of one microbatch's forward through `stage` (and its loss on the last stage)."""
    x = ids if stage.is_first else torch.randn(*ids.shape, dim, requires_grad=True)
    with SavedActivations(stage) as saved:
        out = stage(x)
        if stage.is_last:
            TokenSumLoss()(out, labels)
    return saved.peak


def measure(schedule: str, stages_per_rank: int, m: int, pp: int, args: ModelArgs, rows: int, seq: int) -> dict:
    """On every rank: the step's peak of held activations, and the theory for the same rank."""
    pipe, ids, labels = warm_pipeline(schedule, stages_per_rank, m, pp, args, rows, seq)
    parts = nn.ModuleList(pipe.model_parts)
    with SavedActivations(parts) as saved:
        pipe.step(ids, labels)
    mb = rows // m
    per_stage = {p.spec.index: _one_microbatch_bytes(p, ids[:mb], labels[:mb], args.dim) for p in pipe.model_parts}
    rank = pipe.mesh.get_local_rank("pp")
    actions = schedule_actions(schedule, pp, m, stages_per_rank)[rank]
    return {
        "rank": rank,
        "measured": saved.peak,
        "theory": peak_held_bytes(actions, per_stage),
        "held": saved.peak / sum(per_stage.values()),
        "held_theory": peak_held_bytes(actions, dict.fromkeys(per_stage, 1)) / len(per_stage),
    }


def measure_cp(pcfg: pp_tp.ParallelConfig, args: ModelArgs, rows: int, seq: int) -> dict:
    """On every rank: the peak of saved activations over one step (after a warm-up step) of a pp x cp pipeline."""
    pipe = pp_tp.build_pipeline(Transformer(args), pp_tp.build_mesh(pcfg), pcfg, seq_len=seq)
    ids, labels = batch(args, rows, seq)
    local, masks = seq // pcfg.cp, []

    def pack(t: torch.Tensor) -> torch.Tensor:  # a saved tensor with a [S/cp, S] (or [S, S]) pair of dims: a mask
        if any(t.shape[i : i + 2] == (local, seq) for i in range(t.dim() - 1)):
            masks.append(t.nbytes)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pipe.step(ids, labels)
    with SavedActivations(nn.ModuleList(pipe.model_parts)) as saved:
        pipe.step(ids, labels)
    return {
        "pp rank": pipe.mesh.get_local_rank("pp"),
        "cp rank": pipe.mesh.get_local_rank("cp") if pcfg.cp > 1 else 0,
        "peak": saved.peak,
        "masks": (len(masks), sum(masks)),
    }


def planned_cp(pcfg: pp_tp.ParallelConfig, args: ModelArgs, rows: int, seq: int) -> list[int]:
    """The planner's activation peak per pp rank for the same job (no process group: run before any World)."""
    model = {k: getattr(args, k) for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")}
    parallel = {k: getattr(pcfg, k) for k in ("pp", "cp", "dp_shard", "schedule", "microbatches", "mixed_precision")}
    cfg = config_from_dict(
        {
            "model": {**model, "max_seq_len": seq},
            "parallel": parallel,
            "training": {"batch_size": rows, "seq_len": seq},
        },
        world_size=pcfg.world_size,
    )
    return plan_job(cfg, pcfg.world_size).schedules[0].act_peak_bytes


def main_cp(cps: list[int], seq: int, dim: int, rows: int) -> None:
    """pp2 x cp for each cp at one global batch and sequence: measured peaks per rank against cp = 1 and the plan."""
    args = ModelArgs(vocab_size=512, dim=dim, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=3 * dim, max_seq_len=seq)
    out = []
    for cp in cps:
        pcfg = pp_tp.ParallelConfig(pp=2, cp=cp, dp_shard=1, schedule="1F1B", microbatches=2, mixed_precision="fp32")
        planned = planned_cp(pcfg, args, rows, seq)
        world = World(pcfg.world_size)
        try:
            out += [(cp, r, planned[r["pp rank"]]) for r in world.run(measure_cp, pcfg, args, rows, seq)]
        finally:
            world.close()
    base = {r["pp rank"]: r["peak"] for cp, r, _ in out if cp == 1}
    head = ("cp", "pp rank", "cp rank", "measured MiB", "vs cp=1", "planned MiB", "measured/planned", "[S/cp,S] saved")
    table_rows = [head]
    for cp, r, plan in sorted(out, key=lambda x: (x[0], x[1]["pp rank"], x[1]["cp rank"])):
        vs = f"{r['peak'] / base[r['pp rank']]:.3f}" if base else "-"
        mib, masks = f"{r['peak'] / 2**20:.2f}", f"{r['masks'][0]} ({r['masks'][1] / 2**20:.1f} MiB)"
        table_rows.append(
            (cp, r["pp rank"], r["cp rank"], mib, vs, f"{plan / 2**20:.2f}", f"{r['peak'] / plan:.3f}", masks)
        )
    print(
        f"model dim={args.dim} layers={args.n_layers} heads={args.n_heads}/{args.n_kv_heads} vocab={args.vocab_size}; "
        f"global batch {rows}x{seq}; pp=2 x cp, 1F1B, m=2; fp32; '[S/cp,S] saved': tensors with that pair of dims "
        "saved for backward in one step (count, bytes)"
    )
    print(table(table_rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--cp", type=int, nargs="+", default=None, help="context-parallel degrees (cp 1 first)")
    parser.add_argument("--dim", type=int, default=128, help="with --cp: the model width (ffn 3x)")
    parser.add_argument("--rows", type=int, default=4, help="with --cp: the global batch's rows (2 microbatches)")
    a = parser.parse_args()
    if a.cp:
        main_cp(a.cp, a.seq, a.dim, a.rows)
        return
    args = ModelArgs(vocab_size=512, dim=128, n_layers=4 * a.pp, n_heads=4, ffn_dim=384, max_seq_len=a.seq)
    rows = [
        (
            "schedule",
            "m",
            "pp rank",
            "measured MiB",
            "theory MiB",
            "measured/theory",
            "microbatches held",
            "theory held",
        )
    ]
    world = World(a.pp)
    try:
        for schedule in SCHEDULES:
            for m in a.m:
                if m < a.pp:
                    continue
                for r in world.run(
                    measure, schedule, default_stages_per_rank(schedule, a.pp), m, a.pp, args, 2 * max(a.m), a.seq
                ):
                    rows.append(
                        (
                            schedule,
                            m,
                            r["rank"],
                            f"{r['measured'] / 2**20:.2f}",
                            f"{r['theory'] / 2**20:.2f}",
                            f"{r['measured'] / r['theory']:.3f}",
                            f"{r['held']:.2f}",
                            f"{r['held_theory']:g}",
                        )
                    )
    finally:
        world.close()
    print(
        f"model dim={args.dim} layers={args.n_layers} vocab={args.vocab_size}; batch {2 * max(a.m)}x{a.seq}; "
        f"pp={a.pp}; fp32; Interleaved1F1B with 2 stages per rank"
    )
    print("'microbatches held' counts one microbatch through all of the rank's stages as 1")
    print(table(rows))


if __name__ == "__main__":
    main()
