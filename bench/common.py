"""What the bench scripts share: the multi-rank world, the batch, schedule shapes and the table printer.

Ranks come from the test harness's `World` (gloo, one thread per rank, kept alive across cases), so a
benchmark runs all its variants in one set of processes instead of paying a start per variant.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from harness import World  # noqa: E402  (tests/harness.py: the gloo world the tests use)

import pp_tp  # noqa: E402
from pp_tp.models.reference.model import ModelArgs, Transformer  # noqa: E402
from pp_tp.schedules.registry import default_stages_per_rank  # noqa: E402

__all__ = ["World", "batch", "default_stages_per_rank", "table", "training_args"]


def batch(args: ModelArgs, rows: int, seq: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids and labels, no padding: every variant sees the same global batch."""
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, args.vocab_size, (rows, seq), generator=gen),
        torch.randint(0, args.vocab_size, (rows, seq), generator=gen),
    )


def training_args(doc: str, config: str, steps: int, skip: int) -> argparse.Namespace:
    """--config, --steps, --skip and trailing overrides: the scripts that run the trainer."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--config", default=config)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--skip", type=int, default=skip, help="warm-up steps left out")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as for pp-tp train")
    return parser.parse_args()


def table(rows: Sequence[Sequence[Any]]) -> str:
    """Right-aligned text table; the first row is the header."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)


_MESH: dict = {}


def warm_pipeline(schedule: str, spr: int, m: int, pp: int, args: ModelArgs, rows: int, seq: int):
    """A pp-only pipeline on this rank's cached mesh, after one warm-up step; returns it and its batch."""
    pcfg = pp_tp.ParallelConfig(
        pp=pp, dp_shard=1, schedule=schedule, microbatches=m, stages_per_rank=spr, mixed_precision="fp32"
    )
    if "mesh" not in _MESH:
        _MESH["mesh"] = pp_tp.build_mesh(pcfg)
    with torch.device("meta"):
        model = Transformer(args)
    pipe = pp_tp.build_pipeline(model, _MESH["mesh"], pcfg, seq_len=seq)
    ids, labels = batch(args, rows, seq)
    pipe.step(ids, labels)  # warm-up: builds the schedule and its buffers
    return pipe, ids, labels
