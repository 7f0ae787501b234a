"""The schedule picture: a real step's timeline on every rank beside the simulated schedule, and the bubble.

    python bench/timeline.py --trace timeline.json      # then open timeline.json at https://ui.perfetto.dev
    python bench/timeline.py --schedules 1F1B --m 4 8 16

For each schedule and m, one step runs on pp gloo ranks (one thread each) with pp_tp.diagnostics.timeline's
recorder around the stages' forward/backward, the loss and torch's p2p waits. Bubble = idle over
compute time per rank: measured (step wall time between barriers minus compute), simulated from
torch's action order (F = 1, B = 2 cost units; I = W = 1 where B is split), and theoretical ((p-1)/m,
(p-1)/(v m); for the schedules that split B into I and W, ZB-H1's (p-1)/(3m): the bubble left when
W fills it, with F = I = W). In the trace
one simulated cost unit is drawn as long as the measured mean forward.
"""

from __future__ import annotations

import argparse
import statistics

from common import World, default_stages_per_rank, table, warm_pipeline

from pp_tp.diagnostics.timeline import chrome_trace, record_step, write_trace
from pp_tp.models.reference.model import ModelArgs
from pp_tp.planner.schedule_sim import bubble_fraction, schedule_actions, simulate, theoretical_bubble
from pp_tp.schedules.registry import get_schedule_spec


def record(schedule: str, m: int, pp: int, args: ModelArgs, rows: int, seq: int) -> tuple[list, float]:
    """One recorded step (after a warm-up step) on this rank: its spans and the wall time."""
    pipe, ids, labels = warm_pipeline(schedule, default_stages_per_rank(schedule, pp), m, pp, args, rows, seq)
    return record_step(pipe.schedule, lambda: pipe.step(ids, labels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["GPipe", "1F1B", "Interleaved1F1B"])
    parser.add_argument("--m", type=int, nargs="+", default=[8])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=None, help="global batch rows (default 2 * max m)")
    parser.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    a = parser.parse_args()
    args = ModelArgs(vocab_size=a.vocab, dim=a.dim, n_layers=4 * a.pp, n_heads=8, ffn_dim=3 * a.dim, max_seq_len=a.seq)
    rows = a.rows or 2 * max(a.m)
    out = [("schedule", "m", "v", "measured bubble per rank", "simulated", "theory", "step s")]
    sections = []
    world = World(a.pp)
    try:
        for schedule in a.schedules:
            v = default_stages_per_rank(schedule, a.pp)
            for m in a.m:
                results = world.run(record, schedule, m, a.pp, args, rows, a.seq)
                spans = [s for rank_spans, _ in results for s in rank_spans]
                wall = max(w for _, w in results)
                measured = bubble_fraction(spans, makespan=wall)
                sim = simulate(schedule_actions(schedule, a.pp, m, v))
                theory = theoretical_bubble(schedule, a.pp, m, v)
                if theory is None and get_schedule_spec(schedule).splits_weight_grad:
                    theory = (a.pp - 1) / (3 * m)  # ZB-H1 (Qi et al. 2023), F = I = W
                out.append(
                    (
                        schedule,
                        m,
                        v,
                        " ".join(f"{b:.3f}" for b in measured),
                        f"{max(bubble_fraction(sim)):.3f}",
                        f"{theory:.3f}" if theory is not None else "-",
                        f"{wall:.3f}",
                    )
                )
                forward = statistics.mean(s.dur for s in spans if "F" in s.name and s.kind == "compute")
                sections += [
                    (f"{schedule} m={m} measured", spans, 1e6),
                    (f"{schedule} m={m} simulated", sim, forward * 1e6),
                ]
    finally:
        world.close()
    print(
        f"model dim={a.dim} layers={args.n_layers} vocab={args.vocab_size}; batch {rows}x{a.seq}; pp={a.pp}; "
        "bubble = idle / compute time"
    )
    print(table(out))
    if a.trace:
        write_trace(a.trace, chrome_trace(sections))
        print(f"trace: {a.trace} (open at https://ui.perfetto.dev)")


if __name__ == "__main__":
    main()
