"""Cross-key checks of the `[data]`, `[validation]` and `[checkpoint]` sections, the `[model]` experts keys,
context parallel (`parallel.cp`) and the jobs of models that are not language models (kept apart from validate.py,
which is near its size limit). What needs the files themselves (globs matching nothing, sizes, token ids, columns)
is checked when the source opens (`pp_tp.train.sources.make_source`, run by `pp-tp check` and by every rank before
any collective)."""

from __future__ import annotations

import dataclasses
import os

from pp_tp.config.fields import checked
from pp_tp.config.kinds import DATA_SOURCES, MODEL_KINDS
from pp_tp.config.schema import (
    CHOICES,
    CheckpointConfig,
    DataConfig,
    JobConfig,
    ModelConfig,
    ModelShape,
    MoEConfig,
    ValidationConfig,
    async_save_allowed,
)
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


def check_checkpoint(c: CheckpointConfig) -> CheckpointConfig:
    """`[checkpoint]`'s keys; `async = true` only where DCP's async_save can run (its default there)."""
    c = checked("checkpoint", c)
    if c.async_ and not async_save_allowed():
        raise ConfigError(
            "checkpoint.async = true writes through DCP's async_save, whose background collectives need the gloo "
            "backend, and this torch build has none; set checkpoint.async = false"
        )
    return c


def check_moe(m: ModelShape) -> None:
    """The reference Transformer's experts keys agree with each other (and with `[model]`'s model choice); run on
    the TOML config by `validate` and on the arguments by the model itself, so Python callers meet the same line."""
    routers = CHOICES["model"]["router"]
    if m.router not in routers:
        raise ConfigError(f"model.router = {m.router!r} is not one of {', '.join(routers)}; set model.router to one")
    if not m.n_experts:
        for key, dense in (("n_shared_experts", 0), ("moe_ffn_dim", None), ("moe_every", 1)):
            if getattr(m, key) != dense:
                raise ConfigError(
                    f"model.{key} = {getattr(m, key)} shapes MoE layers, but model.n_experts = 0 (dense); "
                    f"set model.n_experts > 0 or drop model.{key}"
                )
        return
    if isinstance(m, ModelConfig) and (m.hf_path or m.kind != "reference"):
        which = "model.hf_path" if m.hf_path else f"model.kind = {m.kind!r}"
        raise ConfigError(
            f"model.n_experts = {m.n_experts} shapes pp_tp's reference Transformer, but {which} chooses another "
            "model; drop model.n_experts (and the other experts keys)"
        )
    if m.top_k > m.n_experts:
        raise ConfigError(
            f"model.top_k = {m.top_k} exceeds model.n_experts = {m.n_experts}; set model.top_k <= {m.n_experts}"
        )
    if m.moe_every > m.n_layers:
        raise ConfigError(
            f"model.moe_every = {m.moe_every} exceeds model.n_layers = {m.n_layers}, so no layer holds experts; "
            f"set model.moe_every <= {m.n_layers}"
        )


def check_balancing_keys(moe: MoEConfig) -> MoEConfig:
    """The `[moe]` keys on their own (what the model decides is pp_tp.runtime.balancing.check_balancing); run by
    `validate` and by `build_pipeline`'s preflight. Every schedule is accepted: the auxiliary loss's gradient is exact
    under split backward too (tests/test_moe_balancing.py runs ZBVZeroBubble)."""
    return checked("moe", moe)


def check_model_kind(model: ModelConfig) -> ModelConfig:
    """The kind's own keys (its ModelKind.section): defaults where the config was built in code, type-checked like
    any [model] key, then the section's own rules (its `check()`)."""
    section = MODEL_KINDS[model.kind].section if model.kind in MODEL_KINDS else None
    options = section() if section is not None and model.options is None else model.options
    if not (options is None if section is None else isinstance(options, section)):
        want = f"a {section.__name__}" if section else "None (the kind has no keys of its own)"
        raise ConfigError(f"model.options = {options!r} for model.kind = {model.kind!r}: pass {want}")
    if section is not None:
        options = checked("model", options)
        getattr(options, "check", lambda: None)()
    return dataclasses.replace(model, options=options)


def check_non_lm_job(cfg: JobConfig) -> None:
    """A model that is not a language model (its ModelKind names its `data`: CREDIT on gridded fields, the ViT on
    labelled images) reads its own data and only it does, and only such a model takes a training.loss; its image
    splits into patches and its width into heads."""
    m, source = cfg.model, cfg.data.source
    own = MODEL_KINDS[m.kind].data if m.kind in MODEL_KINDS else None
    non_lm = {k: kind.data for k, kind in MODEL_KINDS.items() if kind.data}
    if own != source and (own or (source in DATA_SOURCES and DATA_SOURCES[source].non_lm)):
        pairs = " and ".join(f'model.kind = "{k}" with data.source = "{s}"' for k, s in non_lm.items())
        raise ConfigError(
            f"model.kind = {m.kind!r} with data.source = {source!r}: {pairs} go together and only together; "
            "set both or neither"
        )
    if cfg.training.loss and not own:
        raise ConfigError(
            f"training.loss = {cfg.training.loss!r} is for models that are not language models (model.kind = "
            f"{' or '.join(repr(k) for k in non_lm)}); a language model trains on its token loss, so drop "
            "training.loss"
        )
    if own and m.dim % m.n_heads:
        raise ConfigError(f"model.dim = {m.dim} is not divisible by model.n_heads = {m.n_heads}; change either")


def check_data(d: DataConfig) -> DataConfig:
    """The `[data]` keys agree with each other and with `source` (its `DataSource` record's rules); one line naming
    the key otherwise. An unregistered source is refused where it is opened (train/sources.py)."""
    if d.source in DATA_SOURCES:
        DATA_SOURCES[d.source].check(d)
    if d.weights is not None and (not d.paths or len(d.weights) != len(d.paths) or min(d.weights) <= 0):
        raise ConfigError(
            f"data.weights = {d.weights} must give one positive weight per data.paths entry "
            f"({len(d.paths or [])}); fix data.weights or remove it"
        )
    return d


def check_context_parallel_job(cfg: JobConfig) -> None:
    """The job under context parallel: whole head-tail chunks per cp rank, a language model on token sequences."""
    cp = cfg.parallel.cp
    if cp == 1:
        return
    if cfg.training.seq_len % (2 * cp):
        raise ConfigError(
            f"training.seq_len = {cfg.training.seq_len} is not divisible by 2 * parallel.cp = {2 * cp} (each cp rank "
            f"holds two of {2 * cp} equal chunks); use a multiple of {2 * cp}"
        )
    kind = MODEL_KINDS.get(cfg.model.kind)
    if (kind is not None and kind.data) or cfg.training.loss:
        raise ConfigError(
            f"parallel.cp = {cp} splits token sequences; model.kind = {cfg.model.kind!r} is not a language model, "
            "so set parallel.cp = 1"
        )
