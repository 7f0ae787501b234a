"""Activation memory per pp rank for GPipe, 1F1B and Interleaved1F1B at several m, against the theory.

    python bench/activation_memory.py
    python bench/activation_memory.py --m 2 4 8 16 --pp 2

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
from common import World, default_stages_per_rank, table, warm_pipeline
from torch import nn

from pp_tp.models.reference.model import ModelArgs
from pp_tp.planner import SavedActivations, peak_held_bytes
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    a = parser.parse_args()
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
