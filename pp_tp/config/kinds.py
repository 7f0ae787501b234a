"""Open registries of what `[model] kind` and `[data] source` name: one record per kind, built-ins and plugins alike.

They live with the config because validation reads them (a name is checked, a model that is not a language model is
paired with its data). A record's callable may be given as "module:attribute" and is imported on first use: the
config layer names the built-in data sources of pp_tp.train without importing it (the package graph points down).
Plugins register here, or ship `pp_tp.model_kinds` / `pp_tp.data_sources` entry points (pp_tp/extend/plugins.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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
    process group exists; `non_lm`: it feeds a model that is not a language model (its `ModelKind.data`)."""

    make: Callable[..., Any] | str
    non_lm: bool = False


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


for _name, _non_lm in (
    ("synthetic", False),
    ("text", False),
    ("tokens", False),
    ("dataset", False),
    ("fields", True),
    ("images", True),
):
    register_data_source(_name, DataSource(f"pp_tp.train.sources:make_{_name}", non_lm=_non_lm))
