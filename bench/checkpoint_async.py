"""Step time while a checkpoint is written: no save, a sync save and an async one (`checkpoint.async`), paired.

    python bench/checkpoint_async.py                       # debug_cpu.toml widened (WIDE), 4 ranks, 5 rounds
    python bench/checkpoint_async.py --rounds 8 --block 6 model.dim=512

One world of the config's ranks (gloo, one thread each) runs one `Trainer` (its own checkpoints off) through
`Trainer.run(before_step)`. Steps go in blocks of `--block`; each round has one block per variant, in an order
rotated per round: a block starts with its save (none: nothing; sync: a Checkpointer with checkpoint.async = false,
`dcp.save`; async: one with checkpoint.async = true, `dcp.async_save`), then its steps run, and it ends waiting for
the save's write (async: the part the steps did not hide). Per block, as ratios to the no-save block of the same
round: the save call and the wait at the end over its mean step; the first step after the save (the one an async
write overlaps most), the mean step and the whole block (save + steps + wait) over the same in the no-save block.
Medians over rounds of the paired ratios, rank 0's clock (every step is collective: the ranks agree within a step).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from common import World, table

from pp_tp.config import CheckpointConfig, load_config
from pp_tp.train.checkpoint import Checkpointer
from pp_tp.train.trainer import Trainer

VARIANTS = ("none", "sync", "async")
# debug_cpu.toml's model made wider: 12.6 M parameters, a 146 MiB checkpoint (parameters and AdamW moments).
WIDE = ["model.dim=384", "model.n_layers=8", "model.n_heads=8", "model.ffn_dim=1024", "model.max_seq_len=64"]
WARM = 3  # steps left out before the first block


def _blocks(rounds: int) -> list[str]:
    """The variant of every block: each round once each, the order rotated per round."""
    return [VARIANTS[(r + i) % len(VARIANTS)] for r in range(rounds) for i in range(len(VARIANTS))]


def run(config: str, overrides: list[str], block: int, rounds: int, folder: str) -> list[dict]:
    """This rank's blocks: {"variant", "save", "steps": [s, ...], "wait"} in seconds."""
    blocks = _blocks(rounds)
    cfg = load_config(config, [*overrides, f"training.steps={WARM + len(blocks) * block + 1}"])
    trainer = Trainer(cfg)
    ckpts = {
        v: Checkpointer(
            CheckpointConfig(enable=True, folder=os.path.join(folder, v), keep=1, async_=v == "async"),
            trainer.pipe.model_parts, trainer.optimizers, trainer.schedulers, trainer.loader, trainer.pipe.rng_streams,
        )
        for v in VARIANTS[1:]
    }  # fmt: skip
    out: list[dict] = []
    last = [0.0]

    def before_step(step: int) -> None:
        now = time.perf_counter()
        k = step - 1 - WARM  # steps done in blocks
        if k > 0:
            out[-1]["steps"].append(now - last[0])
        if k >= 0 and k % block == 0:
            if out:
                t = time.perf_counter()
                if out[-1]["variant"] != "none":
                    ckpts[out[-1]["variant"]].wait()
                out[-1]["wait"] = time.perf_counter() - t
            if k // block < len(blocks):
                variant, t = blocks[k // block], time.perf_counter()
                if variant != "none":
                    ckpts[variant].save(step - 1)
                out.append({"variant": variant, "save": time.perf_counter() - t, "steps": []})
        last[0] = time.perf_counter()

    trainer.run(before_step)
    return out


def _summary(blocks: list[dict], rounds: int) -> list[tuple]:
    """Per variant: medians over rounds of its block's ratios to the same round's no-save block."""
    n = len(VARIANTS)
    by_round = [{b["variant"]: b for b in blocks[r * n : (r + 1) * n]} for r in range(rounds)]

    def parts(b: dict) -> dict[str, float]:
        return {
            "save": b["save"],
            "first": b["steps"][0],  # the step the write overlaps most (async)
            "step": statistics.mean(b["steps"]),
            "wait": b["wait"],
            "block": b["save"] + sum(b["steps"]) + b["wait"],
        }

    rows = []
    for v in VARIANTS:
        got = [parts(r[v]) for r in by_round]
        base = [parts(r["none"]) for r in by_round]
        per_step = [statistics.median(g[k] / b["step"] for g, b in zip(got, base)) for k in ("save", "wait")]
        per_none = [statistics.median(g[k] / b[k] for g, b in zip(got, base)) for k in ("first", "step", "block")]
        rows.append((v, *(f"{x:.3f}" for x in per_step + per_none)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="toml_configs/debug_cpu.toml")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=4, help="steps per block (the first after its save)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, after WIDE")
    a = parser.parse_args()
    tmp = tempfile.mkdtemp()
    overrides = [
        *WIDE,
        *a.overrides,
        "checkpoint.enable=false",
        f'training.metrics_file="{os.path.join(tmp, "metrics.jsonl")}"',
        "training.log_every=1000",
    ]
    world_size = load_config(a.config, overrides).parallel.world_size
    load = os.getloadavg()[0]
    world = World(world_size)
    try:
        blocks = world.run(run, a.config, overrides, a.block, a.rounds, tmp, timeout=7200)[0]
    finally:
        world.close()
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(tmp, "sync")) for f in fs)
    shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"{' '.join([a.config, *overrides[: len(WIDE) + len(a.overrides)]])}; {world_size} ranks; checkpoint "
        f"{size / 2**20:.0f} MiB; {a.rounds} rounds of {len(VARIANTS)} blocks x {a.block} steps, medians; "
        f"load average before/after: {load:.1f}/{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    header = ("save", "save call / step", "wait / step", "first step / none", "step / none", "block / none")
    print(table([header, *_summary(blocks, a.rounds)]))


if __name__ == "__main__":
    main()
