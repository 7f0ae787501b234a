"""Pre-tokenized flat token files for `data.source = "tokens"`: `.bin` arrays of `data.dtype` (uint16 or uint32, the
nanoGPT / Megatron layout) or `.npy`, read through memory maps so only the windows a rank takes are paged in.

A component (one `data.paths` entry: a file or a glob of shards) offers non-overlapping windows of `seq_len + 1`
tokens (each shares its last token with the next) inside each of its files, numbered across its files in order.
Opening a file checks its size against the dtype and every id against `model.vocab_size` (one line each).
"""

from __future__ import annotations

import bisect
import os

import numpy as np
import torch

from pp_tp.errors import ConfigError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_SCAN = 1 << 20  # tokens per chunk of the id check: bounded memory whatever the file size


def open_tokens(path: str, dtype: str) -> np.ndarray:
    """A read-only memory map of one token file; refuses a size that is not whole tokens or a non-1-D .npy."""
    if path.endswith(".npy"):
        arr = np.load(path, mmap_mode="r")
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ConfigError(
                f"token file {path!r} holds a {arr.ndim}-D {arr.dtype} array; save a 1-D integer array of token ids"
            )
        return arr
    size, item = os.path.getsize(path), np.dtype(DTYPES[dtype]).itemsize
    if size % item:
        raise ConfigError(
            f"token file {path!r} has {size} bytes, not a multiple of data.dtype = {dtype!r} ({item} bytes); "
            "set data.dtype to the type it was written with"
        )
    if size == 0:
        return np.zeros(0, dtype=DTYPES[dtype])
    return np.memmap(path, dtype=DTYPES[dtype], mode="r")


def check_ids(arr: np.ndarray, path: str, vocab_size: int) -> None:
    """Every id in [0, vocab_size), scanned in chunks by plain reads (not through the map: the scan leaves no
    pages of the file mapped into the rank)."""
    with open(path, "rb") as f:
        f.seek(getattr(arr, "offset", 0))  # a .npy file's header
        while (chunk := np.fromfile(f, dtype=arr.dtype, count=_SCAN)).size:
            if arr.dtype.kind == "i" and int(chunk.min()) < 0:
                raise ConfigError(f"token file {path!r} holds a negative token id ({int(chunk.min())}); fix the file")
            top = int(chunk.max())
            if top >= vocab_size:
                raise ConfigError(
                    f"token file {path!r} holds token id {top} >= model.vocab_size = {vocab_size}; use a model with "
                    f"vocab_size > {top} or the files of this model's tokenizer"
                )


class TokenComponent:
    """The windows of one mixture component's files (a `Source`: `num_samples`, `sample(index)`)."""

    def __init__(self, files: list[str], dtype: str, seq_len: int, vocab_size: int, what: str):
        self.arrays = [open_tokens(f, dtype) for f in files]
        for f, arr in zip(files, self.arrays):
            check_ids(arr, f, vocab_size)
        self.seq_len = seq_len
        counts = [max(0, (len(a) - 1) // seq_len) for a in self.arrays]
        self.starts = [sum(counts[:i]) for i in range(len(counts))]
        self.num_samples = sum(counts)
        if self.num_samples < 1:
            tokens = sum(len(a) for a in self.arrays)
            raise ConfigError(
                f"{what} has no file with training.seq_len + 1 = {seq_len + 1} tokens ({tokens} tokens in "
                f"{len(files)} file(s)); give more data or lower training.seq_len"
            )

    def sample(self, index: int) -> torch.Tensor:
        f = bisect.bisect_right(self.starts, index) - 1
        start = (index - self.starts[f]) * self.seq_len
        return torch.from_numpy(np.asarray(self.arrays[f][start : start + self.seq_len + 1], dtype=np.int64))
