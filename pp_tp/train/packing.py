"""Documents packed into `seq_len + 1` windows, one stream per row of the global batch, and the position ids that
restart at every document (`data.document_mask`).

Row j of every global batch is fed by its own stream, which reads the documents at positions j, j+B, j+2B, ...
of the epoch's shuffled order (B = training.batch_size): EOS-ended documents laid end to end, each window sharing
its last token with the next. So the global batch depends on (seed, epoch, B) only; a DP rank runs just the streams
of its rows, reading and tokenizing only their documents, one document at a time. A stream's state is (epoch,
document, token offset); the checkpoint holds every row's, gathered, so a resume at another layout maps rows to
ranks anew and every row continues where it stopped.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from pp_tp.errors import ConfigError
from pp_tp.train.shuffle import permuted


def document_positions(ids: torch.Tensor, eos: int) -> torch.Tensor:
    """Per-token position ids [batch, seq]: counting from 0 at each row's start and again after every EOS."""
    idx = torch.arange(ids.shape[1]).expand_as(ids)
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, :-1] == eos
    return idx - torch.where(starts, idx, 0).cummax(dim=1).values


class Batch(NamedTuple):
    """This DP rank's share of a global batch: labels are the next tokens; position ids restart after every EOS
    (None without `data.document_mask`)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None


def split_rows(rows: torch.Tensor, eos: int | None) -> Batch:
    """Windows of seq_len + 1 tokens -> (input_ids, labels, position ids when `eos` marks documents)."""
    ids = rows[:, :-1].contiguous()
    return Batch(ids, rows[:, 1:].contiguous(), None if eos is None else document_positions(ids, eos))


class Documents(Protocol):
    """Token ids of documents by index (EOS-ended): what the streams read."""

    num_docs: int

    def tokens(self, index: int) -> list[int]: ...


class _RowStream:
    """One row's documents, windowed; the cursor (epoch, k, offset) is the next window's first token."""

    def __init__(self, docs: Documents, row: int, rows: int, seed: int, seq_len: int):
        self.docs, self.row, self.rows, self.seed, self.seq_len = docs, row, rows, seed, seq_len
        self.epoch = self.k = self.offset = 0
        self._cached: tuple[tuple[int, int], list[int]] | None = None

    def _doc(self) -> list[int]:
        """The cursor's document, moving past empty ones (a blank text without an EOS)."""
        for _ in range(self.docs.num_docs + 1):
            key = (self.epoch, self.k)
            if self._cached is None or self._cached[0] != key:
                n = self.docs.num_docs
                index = permuted(self.row + self.k * self.rows, n, f"{self.seed}:{self.epoch}")
                self._cached = (key, self.docs.tokens(index))
            if self._cached[1]:
                return self._cached[1]
            self._advance_doc()
        raise ConfigError("the dataset's documents tokenize to no tokens at all; check data.text_field")

    def _advance_doc(self) -> None:
        self.k, self.offset = self.k + 1, 0
        if self.row + self.k * self.rows >= self.docs.num_docs:
            self.epoch, self.k = self.epoch + 1, 0

    def window(self) -> list[int]:
        """The next seq_len + 1 tokens; the cursor moves by seq_len (the last one is the next window's first)."""
        out: list[int] = []
        while len(out) < self.seq_len:
            toks = self._doc()
            take = toks[self.offset : self.offset + self.seq_len - len(out)]
            out += take
            self.offset += len(take)
            if self.offset >= len(toks):
                self._advance_doc()
        return out + [self._doc()[self.offset]]

    @property
    def cursor(self) -> tuple[int, int, int]:
        return self.epoch, self.k, self.offset

    @cursor.setter
    def cursor(self, value: tuple[int, int, int]) -> None:
        self.epoch, self.k, self.offset = (int(v) for v in value)


class PackedBatches:
    """This DP rank's rows of each global batch of packed documents (see the module docstring)."""

    def __init__(
        self, docs: Documents, global_batch: int, dp_rank: int, dp_size: int, seed: int, seq_len: int, eos: int | None
    ):
        if docs.num_docs < global_batch:
            raise ConfigError(
                f"the dataset has {docs.num_docs} documents, fewer than training.batch_size = {global_batch} (one "
                "stream of documents per row); give more documents or lower training.batch_size"
            )
        self.global_batch, self.eos = global_batch, eos
        local = global_batch // dp_size
        self.first = dp_rank * local
        self.streams = [_RowStream(docs, r, global_batch, seed, seq_len) for r in range(self.first, self.first + local)]

    def next(self) -> Batch:
        rows = torch.tensor([s.window() for s in self.streams], dtype=torch.long)
        return split_rows(rows, self.eos)

    def snapshot(self) -> torch.Tensor:
        """This rank's rows' cursors [local, 3], taken where the batch was made (no collective)."""
        return torch.tensor([s.cursor for s in self.streams], dtype=torch.long)

    def state_dict(self, snapshot: torch.Tensor | None = None) -> dict:
        """Every row's cursor [batch, 3], gathered from the ranks holding them: the same on every rank."""
        mine = (self.first, self.snapshot() if snapshot is None else snapshot)
        parts = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, mine)
        cursors = torch.zeros(self.global_batch, 3, dtype=torch.long)
        for first, rows in parts:
            cursors[first : first + len(rows)] = rows
        return {"cursors": cursors}

    def load_state_dict(self, state: dict) -> None:
        cursors = state["cursors"]
        if len(cursors) != self.global_batch:
            raise ConfigError(
                f"the checkpoint's data state has {len(cursors)} rows but training.batch_size = {self.global_batch}; "
                "resume with the same training.batch_size"
            )
        for s in self.streams:
            s.cursor = cursors[s.row].tolist()
