"""Open registries of what `[model] kind` and `[data] source` name: one record per kind, built-ins and plugins alike.

They live with the config because validation reads them (a name is checked, a model that is not a language model is
paired with its data). A record's callable may be given as "module:attribute" and is imported on first use: the
config layer names the built-in data sources of pp_tp.train without importing it (the package graph points down).
Plugins register here, or ship `pp_tp.model_kinds` / `pp_tp.data_sources` entry points (pp_tp/extend/plugins.py).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pp_tp.errors import ConfigError


def resolve(target: Callable[..., Any] | str) -> Callable[..., Any]:
    """A callable, or the one a "module:attribute" string names."""
    if callable(target):
        return target
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class ModelKind:
    """One `model.kind`: `build(model_config, device) -> nn.Module` (the [model] keys it reads, on any device, meta
    included); `data`: the `data.source` a model that is not a language model trains on (None: a language model
    on token data, trained on its token loss); `section`: a dataclass of the kind's own [model] keys (defaults for
    each; its `check()`, if any, raises ConfigError on a bad value), held as `model_config.options`."""

    build: Callable[..., Any] | str
    data: str | None = None
    section: type | None = None


@dataclass(frozen=True)
class DataSource:
    """One `data.source`: `make(job_config)` returns an object whose `loader(dp_rank, dp_size)` is this rank's
    resumable batch loader (pp_tp/train/sources.py: WindowData, DocumentData), checking its files before any
    process group exists; `non_lm`: it feeds a model that is not a language model (its `ModelKind.data`).

    What it reads of `[data]`, checked by `check` before anything opens: `files` "" (no path), "file" (data.path, one
    existing file) or "files" (data.path, a file, glob or directory, or data.paths, a list of them: one of the two);
    `tokenizer`: it needs data.tokenizer; `eos` how its documents end, for `data.document_mask`: "" (not a token
    stream: no rule), "none" (byte tokens without an EOS: refused), "tokenizer" (the tokenizer's EOS: needs
    data.tokenizer) or "eos_id" (data.eos_id, which only such a source reads)."""

    make: Callable[..., Any] | str
    non_lm: bool = False
    files: str = ""
    tokenizer: bool = False
    eos: str = ""

    def check(self, d: Any) -> None:
        """Refuses `[data]` keys this source cannot honour, in one line naming the key (`d`: the DataConfig)."""
        src = f'data.source = "{d.source}"'
        if self.files == "file" and not os.path.isfile(d.path):
            raise ConfigError(
                f"data.path = {d.path!r} is not an existing file but {src} reads it; give a text file's path or set "
                'data.source = "synthetic"'
            )
        if self.files == "files" and bool(d.path) == bool(d.paths):
            raise ConfigError(
                f"{src} reads data.path (one file, glob or directory) or data.paths (a list of them); give exactly "
                "one of the two"
            )
        if self.files != "files" and d.paths:
            readers = " or ".join(f'"{n}"' for n, s in DATA_SOURCES.items() if s.files == "files")
            raise ConfigError(f"data.paths is read by data.source = {readers} (it is {d.source!r}); remove it")
        if self.tokenizer and not d.tokenizer:
            raise ConfigError(f"{src} tokenizes text: set data.tokenizer to a tokenizer directory")
        if d.eos_id is not None and self.eos != "eos_id":
            readers = " or ".join(f'"{n}"' for n, s in DATA_SOURCES.items() if s.eos == "eos_id")
            raise ConfigError(
                f"data.eos_id is for data.source = {readers} (it is {d.source!r}); a tokenizer names its own EOS: "
                "remove it"
            )
        if d.document_mask and (self.eos == "none" or (self.eos == "tokenizer" and not d.tokenizer)):
            raise ConfigError(
                f"data.document_mask = true needs documents ended by an EOS token, which {src} with byte tokens has "
                'none; use source "tokens" (with data.eos_id), "dataset", or data.tokenizer'
            )
        if d.document_mask and self.eos == "eos_id" and d.eos_id is None:
            raise ConfigError(
                "data.document_mask = true splits documents at the EOS token: set data.eos_id to the id that ends one"
            )


MODEL_KINDS: dict[str, ModelKind] = {}
DATA_SOURCES: dict[str, DataSource] = {}


def register_model_kind(name: str, kind: ModelKind) -> None:
    """Adds (or replaces) a `model.kind`; the built-ins come in through here too (pp_tp/models/factory.py)."""
    if not isinstance(kind, ModelKind):
        raise TypeError(f"register_model_kind({name!r}, ...) takes a ModelKind record, not {kind!r}")
    MODEL_KINDS[name] = kind


def register_data_source(name: str, source: DataSource) -> None:
    """Adds (or replaces) a `data.source`; the built-ins come in through here too (below)."""
    if not isinstance(source, DataSource):
        raise TypeError(f"register_data_source({name!r}, ...) takes a DataSource record, not {source!r}")
    DATA_SOURCES[name] = source


_BUILT_IN = {  # name -> (non_lm, files, tokenizer, eos)
    "synthetic": (False, "", False, "none"),
    "text": (False, "file", False, "tokenizer"),
    "tokens": (False, "files", False, "eos_id"),
    "dataset": (False, "files", True, "tokenizer"),
    "fields": (True, "", False, ""),
    "images": (True, "", False, ""),
}
for _name, (_non_lm, _files, _tokenizer, _eos) in _BUILT_IN.items():
    register_data_source(_name, DataSource(f"pp_tp.train.sources:make_{_name}", _non_lm, _files, _tokenizer, _eos))
