"""TOML -> typed dataclasses. Every invalid value raises ConfigError naming the key, the value and the fix.

Checks run on the config alone, before any process group exists, so a bad job ends with one line
instead of a hang or a torch assert on some rank. `resolve_parallel` and `check_model_shape` are
the parts `build_pipeline` reuses on a `ParallelConfig` built in Python.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import sys
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterable, TypeVar

from pp_tp.errors import ConfigError
from pp_tp.models.llama import ModelArgs
from pp_tp.schedules.registry import check_schedule

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


@dataclass
class ModelConfig(ModelArgs):
    """The reference Transformer's shape (`[model]`); `kind = "hf_llama"` builds a HF LlamaForCausalLM of it."""

    kind: str = "reference"
    seed: int = 0


@dataclass
class ParallelConfig:
    pp: int = 1
    tp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    schedule: str = "1F1B"
    microbatches: int = 1
    stages_per_rank: int = 1
    split: str = "even"
    layers_per_stage: list[int] | None = None
    stage_fqns: list[list[str]] | None = None
    split_embed_weight: float = 1.0
    split_head_weight: float = 1.0
    fsdp_reshard_after_forward: str | int = "default"
    mixed_precision: str = "bf16"
    activation_checkpoint: str = "none"
    compile: bool = False
    float8: bool = False
    embedding: str = "replicate"
    loss_parallel: bool = False

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank


@dataclass
class TrainingConfig:
    steps: int = 10
    batch_size: int = 8
    seq_len: int = 64
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    max_norm: float = 1.0
    seed: int = 0
    log_every: int = 1
    metrics_file: str = ""
    comm_timeout_s: float = 300.0


@dataclass
class DataConfig:
    source: str = "synthetic"
    path: str = ""


@dataclass
class CheckpointConfig:
    enable: bool = False
    folder: str = "checkpoints"
    interval: int = 0
    keep: int = 2


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


_Section = TypeVar("_Section")

# Allowed strings per section and key. A str|int field (fsdp_reshard_after_forward) is checked here
# only when it holds a string.
_CHOICES: dict[str, dict[str, tuple[str, ...]]] = {
    "model": {"kind": ("reference", "hf_llama")},
    "parallel": {
        "split": ("even", "weighted", "balanced", "layers_per_stage", "explicit"),
        "fsdp_reshard_after_forward": ("default", "always", "never"),
        "mixed_precision": ("bf16", "fp32"),
        "activation_checkpoint": ("none", "full", "selective"),
        "embedding": ("replicate", "vocab_parallel"),
    },
    "data": {"source": ("synthetic", "text")},
}

# (key, lower bound, whether the bound itself is allowed). dp_shard (-1 allowed) has its own check.
_BOUNDS: dict[str, tuple[tuple[str, float, bool], ...]] = {
    "model": tuple((k, 1, True) for k in
                   ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len")),
    "parallel": (("pp", 1, True), ("tp", 1, True), ("dp_replicate", 1, True), ("microbatches", 1, True),
                 ("stages_per_rank", 1, True), ("split_embed_weight", 0, True), ("split_head_weight", 0, True)),
    "training": (("steps", 1, True), ("batch_size", 1, True), ("seq_len", 1, True), ("lr", 0, False),
                 ("warmup_steps", 0, True)),
    "checkpoint": (("interval", 0, True),),
}

# The split that needs a per-stage list, and that list's key.
_SPLIT_ARGS = {"layers_per_stage": "layers_per_stage", "explicit": "stage_fqns"}

_TOML_TYPE_NAMES = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: str, overrides: list[str] | None = None, world_size: int | None = None) -> JobConfig:
    """Reads a TOML job file, applies `section.key=value` overrides, and returns the validated config."""
    raw = _read_toml(path)
    for text in overrides or ():
        section, key, value = _parse_override(text)
        raw[section] = {**_table(raw, section), key: value}
    return config_from_dict(raw, world_size)


def config_from_dict(d: dict[str, Any], world_size: int | None = None) -> JobConfig:
    """Builds and validates a JobConfig from parsed TOML; unknown sections and keys are refused, not ignored."""
    sections = _hints(JobConfig)
    for name in d:
        if name not in sections:
            raise ConfigError(f"unknown section [{name}]{_did_you_mean(name, sections, '[{}]'.format)}; "
                              f"use one of {', '.join(f'[{s}]' for s in sections)}")
    built = {name: _section(name, cls, _table(d, name)) for name, cls in sections.items()}
    return validate(JobConfig(**built), world_size)


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """Plain nested dicts, one per TOML section (None stands for an unset optional key)."""
    return dataclasses.asdict(cfg)


def format_config(cfg: JobConfig) -> str:
    """The config as TOML text that loads back to the same config; unset optional keys are left out."""
    lines = []
    for section, table in config_to_dict(cfg).items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in table.items() if value is not None]
        lines.append("")
    return "\n".join(lines)


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"config file {path!r}: {e.strerror}; pass the path of a readable TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid TOML: {e}; fix the syntax there") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path!r} is not UTF-8 text; pass a TOML file") from None


def _parse_override(text: str) -> tuple[str, str, Any]:
    """`parallel.tp=2` -> ("parallel", "tp", 2); a value that is not TOML (`GPipe`) stays a string."""
    dotted, has_eq, value = text.partition("=")
    section, has_dot, key = dotted.strip().partition(".")
    if not (has_eq and has_dot and section and key):
        raise ConfigError(f"override {text!r} is not of the form section.key=value; write e.g. parallel.tp=2")
    try:
        return section, key, tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return section, key, value.strip()


def _table(d: dict[str, Any], name: str) -> dict[str, Any]:
    table = d.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{name} = {_toml_value(table)} must be a table; put its keys under a [{name}] header")
    return table


def _section(name: str, cls: type[_Section], table: dict[str, Any]) -> _Section:
    known = [f.name for f in fields(cls)]
    for key in table:
        if key not in known:
            raise ConfigError(f"unknown key {name}.{key}{_did_you_mean(key, known, (name + '.{}').format)}; "
                              f"[{name}] takes {', '.join(known)}")
    return cls(**table)


# ---------------------------------------------------------------------------------------------
# Validation


def validate(cfg: JobConfig, world_size: int | None = None) -> JobConfig:
    """Checks every section and their combinations; returns a copy with `parallel.dp_shard = -1` resolved.

    `world_size` None means env WORLD_SIZE if set, else the product of the degrees. The first failure
    raises ConfigError with one line naming the key, the value and the fix.
    """
    parallel = resolve_parallel(cfg.parallel, world_size)
    model = _check_model(cfg.model, parallel)
    return JobConfig(
        model=model,
        parallel=parallel,
        training=_check_training(cfg.training, parallel, model),
        data=_check_data(cfg.data),
        checkpoint=_checked("checkpoint", cfg.checkpoint),
    )


def resolve_parallel(pcfg: ParallelConfig, world_size: int | None = None) -> ParallelConfig:
    """Checks `[parallel]` on its own (types, degrees vs world size, enums, schedule, split lists).

    Returns a copy with dp_shard = -1 replaced by the rest of the world; `world_size` None as in `validate`.
    """
    p = _checked("parallel", pcfg)
    if p.dp_shard < 1 and p.dp_shard != -1:
        raise ConfigError(f"parallel.dp_shard = {p.dp_shard} must be >= 1, or -1 for the rest of the world; "
                          "set parallel.dp_shard = -1")
    p = dataclasses.replace(p, dp_shard=_resolve_dp_shard(p, _world_size(p, world_size)))
    _check_reshard_group(p)
    check_schedule(p.pp, p.stages_per_rank, p.microbatches, p.schedule, p.fsdp_reshard_after_forward)
    _check_split_lists(p)
    return p


def check_model_shape(pcfg: ParallelConfig, *, n_layers: int, n_heads: int, n_kv_heads: int | None,
                      ffn_dim: int, vocab_size: int, dim: int | None = None) -> None:
    """Refuses a model shape TP cannot shard evenly or the pipeline cannot split into its stages.

    `dim` None skips the head_dim checks (models whose head_dim is not dim / n_heads).
    """
    kv_heads = n_kv_heads or n_heads
    if dim is not None:
        _check_divisible("model.dim", dim, "model.n_heads", n_heads)
        if (dim // n_heads) % 2:
            raise ConfigError(f"model.dim / model.n_heads = {dim} / {n_heads} = {dim // n_heads} is an odd head_dim; "
                              "RoPE rotates channel pairs, so pick model.dim and model.n_heads giving an even head_dim")
    _check_divisible("model.n_heads", n_heads, "model.n_kv_heads", kv_heads)
    for key, value in (("model.n_heads", n_heads), ("model.n_kv_heads", kv_heads),
                       ("model.ffn_dim", ffn_dim), ("model.vocab_size", vocab_size)):
        _check_divisible(key, value, "parallel.tp", pcfg.tp)
    _check_layers(pcfg, n_layers)


def _world_size(p: ParallelConfig, world_size: int | None) -> int:
    if world_size is None:
        env = os.environ.get("WORLD_SIZE")
        if env is None:
            return p.pp * p.tp * p.dp_replicate * max(p.dp_shard, 1)
        if not env.strip().isdigit():
            raise ConfigError(f"environment WORLD_SIZE = {env!r} is not an integer; "
                              "unset it or set it to the number of ranks")
        world_size = int(env)
    if world_size < 1:
        raise ConfigError(f"world size {world_size} must be >= 1; pass the number of ranks (--world-size N)")
    return world_size


def _resolve_dp_shard(p: ParallelConfig, world: int) -> int:
    others = p.pp * p.tp * p.dp_replicate
    degrees = f"pp*tp*dp_replicate = {p.pp}*{p.tp}*{p.dp_replicate} = {others}"
    if p.dp_shard == -1:
        if world % others:
            raise ConfigError(f"parallel.dp_shard = -1 cannot fill world size {world}: {degrees} does not divide it; "
                              "change parallel.pp, parallel.tp or parallel.dp_replicate so that their product "
                              f"divides {world}")
        return world // others
    if others * p.dp_shard != world:
        fix = (f"set parallel.dp_shard = {world // others} (or -1)" if world % others == 0 else
               f"change parallel.pp, parallel.tp or parallel.dp_replicate so that their product divides {world}")
        raise ConfigError(f"parallel.dp_shard = {p.dp_shard}: {degrees} times dp_shard is {others * p.dp_shard} "
                          f"but the world size is {world}; {fix}")
    return p.dp_shard


def _check_reshard_group(p: ParallelConfig) -> None:
    r = p.fsdp_reshard_after_forward
    if isinstance(r, int) and (r < 1 or p.dp_shard % r):
        raise ConfigError(f"parallel.fsdp_reshard_after_forward = {r} must be an integer >= 1 dividing "
                          f"parallel.dp_shard = {p.dp_shard} (the group size to reshard to); "
                          f"use a divisor of {p.dp_shard}, or \"default\", \"always\", \"never\"")


def _check_split_lists(p: ParallelConfig) -> None:
    """The per-stage list a split needs: present, one entry per stage, sane entries."""
    key = _SPLIT_ARGS.get(p.split)
    value = getattr(p, key) if key else None
    n = p.num_stages
    if key and value is None:
        raise ConfigError(f"parallel.split = {p.split!r} needs parallel.{key} with one entry per stage ({n}); "
                          f"add parallel.{key} or choose another parallel.split")
    if key and len(value) != n:
        raise ConfigError(f"parallel.{key} has {len(value)} entries but there are {n} stages "
                          f"(parallel.pp * parallel.stages_per_rank); give exactly {n}")
    if any(count < 0 for count in p.layers_per_stage or ()):
        raise ConfigError(f"parallel.layers_per_stage = {p.layers_per_stage} has a negative count; "
                          "make every count >= 0")
    for stage, fqns in enumerate(p.stage_fqns or ()):
        if not fqns:
            raise ConfigError(f"parallel.stage_fqns[{stage}] is empty; give every stage at least one module FQN")


def _check_divisible(key: str, value: int, by_key: str, by: int) -> None:
    if value % by:
        raise ConfigError(f"{key} = {value} is not divisible by {by_key} = {by}; "
                          f"set {by_key} to a divisor of {value} or {key} to a multiple of {by}")


def _check_layers(p: ParallelConfig, n_layers: int) -> None:
    if p.split == "layers_per_stage":
        total = sum(p.layers_per_stage or ())
        if total != n_layers:
            raise ConfigError(f"parallel.layers_per_stage = {p.layers_per_stage} sums to {total} but "
                              f"model.n_layers = {n_layers}; make the counts sum to {n_layers}")
    elif p.split != "explicit" and n_layers < p.num_stages:
        raise ConfigError(f"model.n_layers = {n_layers} is fewer than the {p.num_stages} pipeline stages "
                          "(parallel.pp * parallel.stages_per_rank); lower parallel.pp or parallel.stages_per_rank, "
                          "or add layers")


def _check_model(model: ModelConfig, p: ParallelConfig) -> ModelConfig:
    m = _checked("model", model)
    check_model_shape(p, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
                      ffn_dim=m.ffn_dim, vocab_size=m.vocab_size, dim=m.dim)
    if m.tie_embeddings and p.pp > 1:
        raise ConfigError("model.tie_embeddings = true: tied input/output embeddings across pipeline stages are "
                          "not supported; set model.tie_embeddings = false or parallel.pp = 1")
    return m


def _check_training(training: TrainingConfig, p: ParallelConfig, model: ModelConfig) -> TrainingConfig:
    t = _checked("training", training)
    multiple = p.dp * p.microbatches
    if t.batch_size % multiple:
        raise ConfigError(f"training.batch_size = {t.batch_size} gives a local batch of {t.batch_size / p.dp:g} "
                          f"per DP rank (dp = {p.dp}), which does not split into parallel.microbatches = "
                          f"{p.microbatches}; set training.batch_size to a multiple of dp * microbatches = {multiple}")
    if t.seq_len > model.max_seq_len:
        raise ConfigError(f"training.seq_len = {t.seq_len} exceeds model.max_seq_len = {model.max_seq_len}; "
                          "lower training.seq_len or raise model.max_seq_len")
    return t


def _check_data(data: DataConfig) -> DataConfig:
    d = _checked("data", data)
    if d.source == "text" and not os.path.isfile(d.path):
        raise ConfigError(f"data.path = {d.path!r} is not an existing file but data.source = \"text\" reads it; "
                          "give a text file's path or set data.source = \"synthetic\"")
    return d


# ---------------------------------------------------------------------------------------------
# Table-driven per-field checks: types, bounds, allowed strings


def _checked(section: str, obj: _Section) -> _Section:
    """A copy of one section with every field type-checked (int widened to float), bounded and in its set."""
    hints = _hints(type(obj))
    values = {f.name: _typed(f"{section}.{f.name}", getattr(obj, f.name), hints[f.name]) for f in fields(obj)}
    for key, low, inclusive in _BOUNDS.get(section, ()):
        _check_bound(f"{section}.{key}", values[key], low, inclusive)
    for key, choices in _CHOICES.get(section, {}).items():
        if isinstance(values[key], str) and values[key] not in choices:
            raise ConfigError(f"{section}.{key} = {values[key]!r} is not one of {', '.join(choices)}"
                              f"{_did_you_mean(values[key], choices, repr)}; set {section}.{key} to one of them")
    return type(obj)(**values)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _typed(key: str, value: Any, hint: Any) -> Any:
    if not _matches(value, hint):
        raise ConfigError(f"{key} = {_toml_value(value)} has type {_type_name(type(value))}; "
                          f"set {key} to a value of type {_type_name(hint)}")
    return float(value) if hint is float else value


def _matches(value: Any, hint: Any) -> bool:
    """isinstance against a field annotation: unions, list[...], bool is not an int, int passes as float."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if origin is list:
        return isinstance(value, list) and all(_matches(v, typing.get_args(hint)[0]) for v in value)
    if hint is type(None):
        return value is None
    if isinstance(value, bool):
        return hint is bool
    return isinstance(value, (int, float) if hint is float else hint)


def _type_name(hint: Any) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is list:
        return f"array of {_type_name(args[0])}"
    if args:
        return " or ".join(_type_name(a) for a in args)
    return _TOML_TYPE_NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def _check_bound(key: str, value: float | None, low: float, inclusive: bool) -> None:
    if value is not None and (value < low if inclusive else value <= low):
        op = ">=" if inclusive else ">"
        raise ConfigError(f"{key} = {value} must be {op} {low}; set {key} {op} {low}")


def _did_you_mean(word: str, options: Iterable[str], show: Callable[[str], str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {show(close[0])}?)" if close else ""


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "JobConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainingConfig",
    "check_model_shape",
    "config_from_dict",
    "config_to_dict",
    "format_config",
    "load_config",
    "resolve_parallel",
    "validate",
]
