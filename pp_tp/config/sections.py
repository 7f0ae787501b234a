"""Cross-key checks of the `[data]` and `[validation]` sections (kept apart from validate.py, which is near its size
limit). What needs the files themselves (globs matching nothing, sizes, token ids, columns) is checked when the source
opens (`pp_tp.train.sources.make_source`, run by `pp-tp check` and by every rank before any collective)."""

from __future__ import annotations

import os

from pp_tp.config.schema import DataConfig, ValidationConfig
from pp_tp.errors import ConfigError


def check_validation(v: ValidationConfig, data: DataConfig) -> ValidationConfig:
    """Held-out text exists, or a split of the training text is asked for; one line naming the key otherwise."""
    if not v.every:
        return v
    if v.path and not os.path.isfile(v.path):
        raise ConfigError(f"validation.path = {v.path!r} is not an existing file; give a held-out text file")
    if v.path and v.split:
        raise ConfigError("validation.path and validation.split both choose the held-out text; keep one of them")
    if not v.path and not 0 < v.split < 1:
        raise ConfigError(
            f"validation.every = {v.every} needs held-out text: set validation.path, or validation.split "
            "in (0, 1) to hold out the end of the training text"
        )
    if not v.path and data.source != "text":
        raise ConfigError(
            f"validation.split = {v.split} splits the training text, but data.source = {data.source!r}; "
            'set data.source = "text" or give validation.path'
        )
    return v


def check_data(d: DataConfig) -> DataConfig:
    """The `[data]` keys agree with each other and with `source`; one line naming the key otherwise."""
    if d.source == "text" and not os.path.isfile(d.path):
        raise ConfigError(
            f'data.path = {d.path!r} is not an existing file but data.source = "text" reads it; '
            'give a text file\'s path or set data.source = "synthetic"'
        )
    files = d.source in ("tokens", "dataset")
    if files and bool(d.path) == bool(d.paths):
        raise ConfigError(
            f"data.source = {d.source!r} reads data.path (one file, glob or directory) or data.paths (a list of "
            "them); give exactly one of the two"
        )
    if not files and d.paths:
        raise ConfigError(f'data.paths is read by data.source = "tokens" or "dataset" (it is {d.source!r}); remove it')
    if d.weights is not None and (not d.paths or len(d.weights) != len(d.paths) or min(d.weights) <= 0):
        raise ConfigError(
            f"data.weights = {d.weights} must give one positive weight per data.paths entry "
            f"({len(d.paths or [])}); fix data.weights or remove it"
        )
    if d.source == "dataset" and not d.tokenizer:
        raise ConfigError('data.source = "dataset" tokenizes text: set data.tokenizer to a tokenizer directory')
    if d.eos_id is not None and d.source != "tokens":
        raise ConfigError(
            f'data.eos_id is for data.source = "tokens" (it is {d.source!r}); a tokenizer names its own EOS: remove it'
        )
    if d.document_mask and (d.source == "synthetic" or (d.source == "text" and not d.tokenizer)):
        raise ConfigError(
            f"data.document_mask = true needs documents ended by an EOS token, which data.source = {d.source!r} "
            'with byte tokens has none; use source "tokens" (with data.eos_id), "dataset", or data.tokenizer'
        )
    if d.document_mask and d.source == "tokens" and d.eos_id is None:
        raise ConfigError(
            "data.document_mask = true splits documents at the EOS token: set data.eos_id to the id that ends one"
        )
    return d
