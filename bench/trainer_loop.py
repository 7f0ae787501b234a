"""Where a `pp-tp train` step goes: Pipeline.step against the trainer's own loop (data, clip, optimizer, logging).

    python bench/trainer_loop.py                                   # debug_cpu.toml, 4 ranks, 40 steps
    python bench/trainer_loop.py --steps 60 --skip 10
    python bench/trainer_loop.py --steps 40 --skip 10 parallel.tp=1 parallel.dp_shard=2 parallel.float8=true \
        parallel.float8_fsdp_all_gather=true                     # FSDP with float8 all-gather instead of TP

Runs `pp_tp.train.trainer.train` on the config's ranks (gloo, one thread each; checkpoints off, metrics to a
temporary file) with timers around Pipeline.step, the loader, zero_grad, clipping, the optimizer and
LR steps and the metrics logger. A step is the time from one `before_step` call to the next, so
everything the loop does counts; "other" is the rest (non-finite guard, validation, peer watch, Python).
Shares are medians over the steps after the first `--skip` ones, per rank.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from common import World, table, training_args

import pp_tp.train.trainer as trainer
from pp_tp.config import load_config

PARTS = ("Pipeline.step", "data", "zero_grad", "clip", "optimizer", "lr", "metrics")


@contextlib.contextmanager
def _timed(spent: dict[str, float]) -> Iterator[Callable[[Any, str, str], None]]:
    """Wraps attributes in place (restored on exit) so their seconds add up in `spent`."""
    saved: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, attr: str, part: str) -> None:
        fn = getattr(owner, attr)
        saved.append((owner, attr, fn))

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - t

        setattr(owner, attr, timed)

    try:
        yield wrap
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)


def run(config: str, overrides: list[str]) -> list[dict[str, float]]:
    """Trains on this rank with timers; one {part: seconds, "step": seconds} per step."""
    cfg = load_config(config, overrides)
    spent: dict[str, float] = defaultdict(float)
    steps: list[dict[str, float]] = []
    last = [0.0]

    def before_step(step: int) -> None:
        now = time.perf_counter()
        if step > 1:
            steps.append({**spent, "step": now - last[0]})
        spent.clear()
        last[0] = now

    with _timed(spent) as wrap:
        wrap(trainer.pp_tp.Pipeline, "step", "Pipeline.step")
        wrap(trainer.Prefetcher, "next", "data")
        wrap(torch.optim.Optimizer, "zero_grad", "zero_grad")
        wrap(trainer, "clip_grad_norm_", "clip")
        wrap(torch.optim.AdamW, "step", "optimizer")
        wrap(torch.optim.lr_scheduler.LRScheduler, "step", "lr")
        wrap(trainer.MetricsLogger, "log", "metrics")
        trainer.train(cfg, before_step)
    return steps


def main() -> None:
    a = training_args(__doc__, "toml_configs/debug_cpu.toml", 40, 5)
    tmp = tempfile.mkdtemp()
    overrides = [
        *a.overrides,
        f"training.steps={a.steps}",
        "checkpoint.enable=false",
        f'training.metrics_file="{os.path.join(tmp, "metrics.jsonl")}"',
    ]
    cfg = load_config(a.config, overrides)
    world_size = cfg.parallel.world_size
    load = os.getloadavg()[0]
    world = World(world_size)
    try:
        per_rank = world.run(run, a.config, overrides)
    finally:
        world.close()
    rows = [("rank", "step ms") + PARTS + ("other", "outside Pipeline.step")]
    for rank, steps in enumerate(per_rank):
        steps = steps[a.skip :]
        med = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in PARTS + ("step",)}
        share = [statistics.median(s.get(k, 0.0) / s["step"] for s in steps) for k in PARTS]
        outside = statistics.median(1 - s.get("Pipeline.step", 0.0) / s["step"] for s in steps)
        rows.append(
            (rank, f"{1e3 * med['step']:.1f}", *(f"{100 * x:.1f}%" for x in share))
            + (f"{100 * (1 - sum(share)):.1f}%", f"{100 * outside:.1f}%")
        )
    print(
        f"{' '.join([a.config, *a.overrides])}, {world_size} ranks, {a.steps} steps (first {a.skip} left out), "
        f"medians of per-step shares; load average before/after: {load:.1f}/{os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
