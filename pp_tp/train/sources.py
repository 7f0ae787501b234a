"""The job's training data, opened and checked before any process group exists (`pp-tp check` runs the same):
`make_source(cfg)` gives an object whose `loader(dp_rank, dp_size)` is this rank's resumable batch loader."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

from pp_tp.config import JobConfig
from pp_tp.config.kinds import DATA_SOURCES, resolve
from pp_tp.errors import ConfigError
from pp_tp.train.data import VOCAB, SyntheticSource, TextSource
from pp_tp.train.documents import DatasetDocuments
from pp_tp.train.fields import SyntheticFields
from pp_tp.train.images import SyntheticImages
from pp_tp.train.loader import ShardedBatches, Source
from pp_tp.train.packing import PackedBatches
from pp_tp.train.text_tokens import eos_id, load_tokenizer, train_windows
from pp_tp.train.token_files import TokenComponent


@dataclass
class WindowData:
    """Window sources (text, synthetic, token files) with their mixture weights."""

    sources: list[Source]
    weights: list[float] | None
    eos: int | None
    cfg: JobConfig

    def loader(self, dp_rank: int, dp_size: int) -> ShardedBatches:
        t = self.cfg.training
        return ShardedBatches(self.sources, t.batch_size, dp_rank, dp_size, t.seed, self.weights, self.eos)


@dataclass
class DocumentData:
    """A dataset's documents, packed per row of the global batch."""

    docs: DatasetDocuments
    cfg: JobConfig

    def loader(self, dp_rank: int, dp_size: int) -> PackedBatches:
        t, eos = self.cfg.training, self.docs.eos if self.cfg.data.document_mask else None
        return PackedBatches(self.docs, t.batch_size, dp_rank, dp_size, t.seed, t.seq_len, eos)


def expand(pattern: str, key: str) -> list[str]:
    """A path or glob's files, sorted (a directory stands for itself: a folder or saved dataset, `dataset_files`);
    one line when nothing matches."""
    if os.path.isdir(pattern):
        return [pattern]
    files = sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
    if not files:
        raise ConfigError(f"{key} = {pattern!r} matches no file; give an existing file, glob or directory")
    return files


def _patterns(cfg: JobConfig) -> list[tuple[str, str]]:
    d = cfg.data
    return [(d.path, "data.path")] if d.path else [(p, f"data.paths[{i}]") for i, p in enumerate(d.paths or [])]


def _document_eos(eos: int | None, cfg: JobConfig) -> int | None:
    if cfg.data.document_mask and eos is None:
        raise ConfigError(
            f"data.document_mask = true splits documents at EOS, but data.tokenizer = {cfg.data.tokenizer!r} names "
            "no EOS token (tokenizer_config.json eos_token); add one or set data.document_mask = false"
        )
    return eos if cfg.data.document_mask else None


def make_source(cfg: JobConfig) -> WindowData | DocumentData:
    """The job's data through the `data.source` registry (pp_tp/config/kinds.py: the built-ins below, plugins
    alike); every check on the files runs here, before any process group (one line each)."""
    d = cfg.data
    if d.source not in DATA_SOURCES:
        raise ConfigError(
            f"data.source = {d.source!r} is not registered; use one of {', '.join(DATA_SOURCES)} or register it "
            "(pp_tp.extend.register_data_source, or a pp_tp.data_sources entry point)"
        )
    return resolve(DATA_SOURCES[d.source].make)(cfg)


def _bytes_fit(cfg: JobConfig) -> None:
    """Byte tokens (text without a tokenizer, synthetic) need a vocabulary of at least 256."""
    d, vocab = cfg.data, cfg.model.vocab_size
    if vocab < VOCAB and not d.tokenizer:
        raise ConfigError(
            f"model.vocab_size = {vocab}: data.source = {d.source!r} uses byte "
            f"tokens 0..255; set model.vocab_size >= {VOCAB}"
        )


def make_fields(cfg: JobConfig) -> WindowData:
    """Synthetic gridded fields (the CREDIT model's one-step forecast)."""
    t, m = cfg.training, cfg.model
    return WindowData([SyntheticFields(t.seed, m.options.channels, m.options.image_size)], None, None, cfg)


def make_images(cfg: JobConfig) -> WindowData:
    """Synthetic labelled images (the ViT's classes)."""
    t, g = cfg.training, cfg.model.options
    return WindowData([SyntheticImages(t.seed, g.channels, g.image_size, g.n_classes)], None, None, cfg)


def make_tokens(cfg: JobConfig) -> WindowData:
    """Pre-tokenized flat files through memory maps, a mixture by `weights` (default: by size)."""
    d, t = cfg.data, cfg.training
    comps = [
        TokenComponent(expand(p, key), d.dtype, t.seq_len, cfg.model.vocab_size, f"{key} = {p!r}")
        for p, key in _patterns(cfg)
    ]
    weights = d.weights or ([float(c.num_samples) for c in comps] if len(comps) > 1 else None)
    return WindowData(comps, weights, d.eos_id if d.document_mask else None, cfg)


def make_dataset(cfg: JobConfig) -> DocumentData:
    """Text files or a saved dataset read through `datasets`, tokenized on the fly, packed."""
    d = cfg.data
    entries = [(key, p, expand(p, key)) for p, key in _patterns(cfg)]
    what = f"data.path = {d.path!r}" if d.path else f"data.paths = {d.paths}"
    docs = DatasetDocuments(entries, d.text_field, d.tokenizer, cfg.model.vocab_size, what)
    _document_eos(docs.eos, cfg)
    return DocumentData(docs, cfg)


def make_text(cfg: JobConfig) -> WindowData:
    """A text file in bytes, or with `data.tokenizer` its tokens (or a held-out tail of the text for validation)."""
    d = cfg.data
    _bytes_fit(cfg)
    if d.tokenizer or (cfg.validation.every and cfg.validation.split):
        eos = _document_eos(eos_id(d.tokenizer, load_tokenizer(d.tokenizer)) if d.tokenizer else None, cfg)
        return WindowData([train_windows(cfg)], None, eos, cfg)  # tokenizer.json, or a held-out tail of the text
    return WindowData([TextSource(d.path, cfg.training.seq_len)], None, None, cfg)


def make_synthetic(cfg: JobConfig) -> WindowData:
    """Random byte tokens from the seed."""
    _bytes_fit(cfg)
    d = cfg.data
    if d.tokenizer or (cfg.validation.every and cfg.validation.split):
        raise ConfigError(f'data.tokenizer encodes text: set data.source = "text" (it is {d.source!r})')
    return WindowData([SyntheticSource(cfg.training.seed, cfg.training.seq_len)], None, None, cfg)
