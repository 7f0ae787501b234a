"""Data time as a share of the training step: the background loader (`data.prefetch = 2`) against the same loader
inline (`data.prefetch = 0`), side by side in one set of ranks.

    python bench/data_time.py                                      # corpus_cpu.toml: dataset + tokenizer + masks
    python bench/data_time.py --config toml_configs/hf_tiny_cpu.toml --steps 40

Each rank runs `pp_tp.train.trainer.train` (checkpoints off, metrics to a temporary file) once per setting; a
step's data time is its wait for the batch (`data_s` in the metrics row), the step time is the whole step's. The
table gives per-setting medians over the steps after `--skip`, worst rank: data ms, step ms and data / step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from common import World, table, training_args

from pp_tp.config import load_config


def run(config: str, overrides: list[str]) -> list[dict]:
    """One training run on this rank (the config read as `pp-tp train` reads it); its metrics rows."""
    from pp_tp.cli.job import load_job
    from pp_tp.train.trainer import train

    return train(load_job(argparse.Namespace(config=config, overrides=overrides, world_size=None)))


def main() -> None:
    a = training_args(__doc__, "toml_configs/corpus_cpu.toml", 40, 5)
    tmp = tempfile.mkdtemp()
    base = [*a.overrides, f"training.steps={a.steps}", "checkpoint.enable=false", 'training.tensorboard_dir=""']
    world = World(load_config(a.config, base).parallel.world_size)
    load = os.getloadavg()[0]
    rows = [("data.prefetch", "data ms", "step ms", "data / step")]
    try:
        for depth in (2, 0):
            metrics = f'training.metrics_file="{os.path.join(tmp, f"m{depth}.jsonl")}"'
            per_rank = [r[a.skip :] for r in world.run(run, a.config, [*base, f"data.prefetch={depth}", metrics])]
            worst = max(per_rank, key=lambda r: statistics.median(x["data_s"] / x["step_time_s"] for x in r))
            rows.append(
                (
                    depth,
                    f"{1e3 * statistics.median(x['data_s'] for x in worst):.2f}",
                    f"{1e3 * statistics.median(x['step_time_s'] for x in worst):.1f}",
                    f"{100 * statistics.median(x['data_s'] / x['step_time_s'] for x in worst):.2f}%",
                )
            )
    finally:
        world.close()
    print(
        f"{' '.join([a.config, *a.overrides])}, {a.steps} steps (first {a.skip} left out), worst rank's medians; "
        f"load average before/after: {load:.1f}/{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
