"""Batches of windows shared out over DP ranks, in a seeded order that depends on (seed, epoch) only.

The global batch of step k is global samples [k*B, (k+1)*B); DP rank r takes its contiguous share. Sample g
comes from one component of the mixture (a counter-based hash of (seed, g) drawn by the weights; always the
only one without a mixture) and is that component's next window in its own per-epoch shuffled order
(`shuffle.permuted`: no index array, so memory does not grow with the corpus). Every rank draws the component
of every global sample, so the per-component counters (offset and epoch) are global and the order does not
depend on the layout: a run resumed at another DP degree sees the same global batches. The state is the
number of global samples consumed and each component's count.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

import torch

from pp_tp.errors import ConfigError
from pp_tp.train.packing import Batch, split_rows
from pp_tp.train.shuffle import permuted


class Source(Protocol):
    """Samples of `seq_len + 1` tokens (or (input, target) pairs: train/fields.py) by index; `num_samples` None
    means endless (no epochs, no shuffle)."""

    num_samples: int | None

    def sample(self, index: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def _unit(seed: int, g: int) -> float:
    """A uniform number in [0, 1) from (seed, global sample): the mixture's draw, with no state beyond g."""
    digest = hashlib.blake2b(f"{seed}:{g}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


class ShardedBatches:
    """This DP rank's share of each global batch of windows, in a deterministic, resumable order."""

    def __init__(
        self,
        sources: Sequence[Source],
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        weights: Sequence[float] | None = None,
        eos: int | None = None,
    ):
        if global_batch % dp_size:
            raise ConfigError(
                f"training.batch_size = {global_batch} does not split over {dp_size} DP ranks; "
                f"use a multiple of {dp_size}"
            )
        self.sources, self.global_batch, self.seed, self.eos = list(sources), global_batch, seed, eos
        total = float(sum(weights)) if weights else 1.0
        self.cumulative = [sum(weights[: i + 1]) / total for i in range(len(weights))] if weights else [1.0]
        self.local = global_batch // dp_size
        self.offset = dp_rank * self.local
        self.position = 0
        self.consumed = [0] * len(self.sources)

    def _component(self, g: int) -> int:
        if len(self.sources) == 1:
            return 0
        u = _unit(self.seed, g)
        return next((c for c, edge in enumerate(self.cumulative) if u < edge), len(self.sources) - 1)

    def _index(self, c: int, k: int) -> int:
        """Component c's k-th sample: its epoch k // n, shuffled by (seed, component, epoch)."""
        n = self.sources[c].num_samples
        if n is None:
            return k
        return permuted(k % n, n, f"{self.seed}:{c}:{k // n}")

    def next(self) -> Batch:
        """This rank's rows of the next global batch."""
        rows = []
        for g in range(self.position, self.position + self.global_batch):
            c = self._component(g)
            if self.offset <= g - self.position < self.offset + self.local:
                rows.append(self.sources[c].sample(self._index(c, self.consumed[c])))
            self.consumed[c] += 1
        self.position += self.global_batch
        if isinstance(rows[0], tuple):  # (input, target) pairs: stacked as they are
            return Batch(torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows]))
        return split_rows(torch.stack(rows), self.eos)

    def snapshot(self) -> dict:
        """The state after the last batch, taken where the batch was made (no collective)."""
        return {"position": self.position, "consumed": torch.tensor(self.consumed, dtype=torch.long)}

    def state_dict(self, snapshot: dict | None = None) -> dict:
        """The checkpoint's entry: the same on every rank (global counters)."""
        return dict(snapshot or self.snapshot())

    def load_state_dict(self, state: dict) -> None:
        consumed = [int(x) for x in state["consumed"]]
        if len(consumed) != len(self.sources):
            raise ConfigError(
                f"the checkpoint's data state has {len(consumed)} mixture components but data.paths gives "
                f"{len(self.sources)}; resume with the same data.paths"
            )
        self.position, self.consumed = int(state["position"]), consumed
