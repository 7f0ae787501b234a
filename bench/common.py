"""What every bench script shares: the multi-rank world, the batch, the raw-torch split, timing and tables.

Ranks come from the test harness's `World` (gloo, one thread per rank, kept alive across cases), so a
benchmark runs its variants interleaved in one set of processes instead of paying a start per variant.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from harness import World  # noqa: E402  (tests/harness.py: the gloo world the tests use)

from pp_tp.models.llama import ModelArgs, Transformer  # noqa: E402

__all__ = ["World", "RawHalf", "batch", "interleaved", "mean_ce", "median", "table", "timed_step"]


def batch(args: ModelArgs, rows: int, seq: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids and labels, no padding: every variant sees the same global batch."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, args.vocab_size, (rows, seq), generator=gen),
            torch.randint(0, args.vocab_size, (rows, seq), generator=gen))


class RawHalf(nn.Module):
    """A hand-split half of the reference Transformer for the raw torch.distributed.pipelining baseline.

    First half: embedding + its blocks; second half: its blocks + norm + head. No pp_tp code runs in it.
    """

    def __init__(self, model: Transformer, layers: Sequence[int], first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleList(model.layers[str(i)] for i in layers)
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope", model.rope, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h)) if self.output is not None else h


def mean_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def timed_step(step: Callable[[], Any], params: Sequence[nn.Parameter]) -> float:
    """Wall seconds of one step on all ranks: barrier, step, barrier (the slowest rank sets the time)."""
    for p in params:
        p.grad = None
    dist.barrier()
    t0 = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - t0


def interleaved(world: World, case: Callable[..., Any], variants: Sequence[Any], reps: int) -> dict[Any, list]:
    """Runs `case(variant)` on every rank, variants in turn (A B C A B C ...), `reps` rounds.

    Interleaving spreads a noisy neighbour's load over all variants instead of one. Returns rank 0's
    results per variant.
    """
    out: dict[Any, list] = {v: [] for v in variants}
    for _ in range(reps):
        for v in variants:
            out[v].append(world.run(case, v)[0])
    return out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def table(rows: Sequence[Sequence[Any]]) -> str:
    """Right-aligned text table; the first row is the header."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)
