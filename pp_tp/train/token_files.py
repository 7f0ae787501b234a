"""Pre-tokenized flat token files for `data.source = "tokens"`: `.bin` arrays of `data.dtype` (uint16 or uint32, the
nanoGPT / Megatron layout) or `.npy`, read through memory maps so only the windows a rank takes are paged in.

A component (one `data.paths` entry: a file or a glob of shards) offers non-overlapping windows of `seq_len + 1`
tokens (each shares its last token with the next) inside each of its files, numbered across its files in order.
Opening a file checks its size against the dtype and every id against `model.vocab_size` (one line each).
"""

from __future__ import annotations

import bisect
import mmap
import os

import numpy as np
import torch

from pp_tp.errors import ConfigError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_SCAN = 1 << 20  # tokens per chunk of the id check: bounded memory whatever the file size


class TokenFile:
    """One token file's ids through a read-only memory map (or an in-memory empty array)."""

    def __init__(self, path: str, dtype: np.dtype, offset: int):
        self.dtype, self.offset = np.dtype(dtype), offset
        self.mapped: mmap.mmap | None = None
        if os.path.getsize(path) > offset:
            with open(path, "rb") as f:
                self.mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.mapped.madvise(mmap.MADV_RANDOM)  # windows come in shuffled order: no read-ahead
            self.tokens = np.frombuffer(self.mapped, dtype=self.dtype, offset=offset)
        else:
            self.tokens = np.zeros(0, dtype=self.dtype)

    def window(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) as int64, copied out; the map's pages for them are released from this process
        right away (they stay in the kernel's page cache), so the rank's resident set does not grow as it reads."""
        out = self.tokens[start : start + n].astype(np.int64)
        lo = (self.offset + start * self.dtype.itemsize) // mmap.PAGESIZE * mmap.PAGESIZE
        self.mapped.madvise(mmap.MADV_DONTNEED, lo, self.offset + (start + n) * self.dtype.itemsize - lo)
        return out


def open_tokens(path: str, dtype: str) -> TokenFile:
    """One token file, mapped; refuses a size that is not whole tokens or a .npy that is not 1-D integers."""
    if path.endswith(".npy"):
        header = np.load(path, mmap_mode="r")
        if header.ndim != 1 or header.dtype.kind not in "iu":
            raise ConfigError(
                f"token file {path!r} holds a {header.ndim}-D {header.dtype} array; save a 1-D integer array of "
                "token ids"
            )
        return TokenFile(path, header.dtype, os.path.getsize(path) - header.nbytes)
    size, item = os.path.getsize(path), np.dtype(DTYPES[dtype]).itemsize
    if size % item:
        raise ConfigError(
            f"token file {path!r} has {size} bytes, not a multiple of data.dtype = {dtype!r} ({item} bytes); "
            "set data.dtype to the type it was written with"
        )
    return TokenFile(path, DTYPES[dtype], 0)


def check_ids(file: TokenFile, path: str, vocab_size: int) -> None:
    """Every id in [0, vocab_size), scanned in chunks by plain reads (not through the map: the scan leaves no
    pages of the file mapped into the rank)."""
    with open(path, "rb") as f:
        f.seek(file.offset)  # past a .npy file's header
        while (chunk := np.fromfile(f, dtype=file.dtype, count=_SCAN)).size:
            if file.dtype.kind == "i" and int(chunk.min()) < 0:
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
        self.files = [open_tokens(f, dtype) for f in files]
        for path, file in zip(files, self.files):
            check_ids(file, path, vocab_size)
        self.seq_len = seq_len
        counts = [max(0, (len(f.tokens) - 1) // seq_len) for f in self.files]
        self.starts = [sum(counts[:i]) for i in range(len(counts))]
        self.num_samples = sum(counts)
        if self.num_samples < 1:
            tokens = sum(len(f.tokens) for f in self.files)
            raise ConfigError(
                f"{what} has no file with training.seq_len + 1 = {seq_len + 1} tokens ({tokens} tokens in "
                f"{len(files)} file(s)); give more data or lower training.seq_len"
            )

    def sample(self, index: int) -> torch.Tensor:
        f = bisect.bisect_right(self.starts, index) - 1
        start = (index - self.starts[f]) * self.seq_len
        return torch.from_numpy(self.files[f].window(start, self.seq_len + 1))
