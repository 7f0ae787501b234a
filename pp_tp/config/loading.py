"""TOML files and `section.key=value` overrides -> a validated JobConfig, and back to TOML text."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import fields
from typing import Any

from pp_tp.config.fields import Section, did_you_mean, hints, toml_key, toml_value
from pp_tp.config.kinds import MODEL_KINDS
from pp_tp.config.schema import JobConfig, ModelConfig
from pp_tp.config.validate import validate
from pp_tp.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def load_config(path: str, overrides: list[str] | None = None, world_size: int | None = None) -> JobConfig:
    """Reads a TOML job file, applies `section.key=value` overrides, and returns the validated config."""
    return config_from_dict(job_dict(path, overrides), world_size)


def job_dict(path: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """The TOML job file with the overrides applied, as parsed tables (nothing validated or resolved yet)."""
    raw = _read_toml(path)
    for text in overrides or ():
        section, key, value = _parse_override(text)
        raw[section] = {**_table(raw, section), key: value}
    return raw


def config_from_dict(d: dict[str, Any], world_size: int | None = None) -> JobConfig:
    """Builds and validates a JobConfig from parsed TOML; unknown sections and keys are refused, not ignored."""
    sections = hints(JobConfig)
    for name in d:
        if name not in sections:
            raise ConfigError(
                f"unknown section [{name}]{did_you_mean(name, sections, '[{}]'.format)}; "
                f"use one of {', '.join(f'[{s}]' for s in sections)}"
            )
    built = {name: _section(name, cls, _table(d, name)) for name, cls in sections.items() if name != "model"}
    return validate(JobConfig(model=_model_section(_table(d, "model")), **built), world_size)


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """Plain nested dicts, one per TOML section, keyed as in TOML (None stands for an unset optional key); the
    model kind's own keys sit in [model] beside the common ones, as in the file."""
    out = {name: {toml_key(k): v for k, v in table.items()} for name, table in dataclasses.asdict(cfg).items()}
    out["model"].update(out["model"].pop("options") or {})
    return out


def format_config(cfg: JobConfig) -> str:
    """The config as TOML text that loads back to the same config; unset optional keys are left out."""
    lines = []
    for section, table in config_to_dict(cfg).items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in table.items() if value is not None]
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
        raise ConfigError(f"{name} = {toml_value(table)} must be a table; put its keys under a [{name}] header")
    return table


def _section(name: str, cls: type[Section], table: dict[str, Any], also: tuple[str, ...] = ()) -> Section:
    """One TOML table as its dataclass; `also`: keys taken elsewhere (a model kind's own), named in the refusal."""
    known = {toml_key(f.name): f.name for f in fields(cls) if f.metadata.get("toml", True)}
    for key in table:
        if key not in known:
            takes = [*known, *also]
            raise ConfigError(
                f"unknown key {name}.{key}{did_you_mean(key, takes, (name + '.{}').format)}; "
                f"[{name}] takes {', '.join(takes)}"
            )
    return cls(**{known[key]: value for key, value in table.items()})


def _model_section(table: dict[str, Any]) -> ModelConfig:
    """[model]: the common keys, and the kind's own (its ModelKind.section) as `options`."""
    name = table.get("kind", ModelConfig.kind)
    kind = MODEL_KINDS.get(name) if isinstance(name, str) else None  # a kind of the wrong type: refused by validation
    own = tuple(toml_key(f.name) for f in fields(kind.section)) if kind and kind.section else ()
    model = _section("model", ModelConfig, {k: v for k, v in table.items() if k not in own}, own)
    if not own:
        return model
    return dataclasses.replace(model, options=_section("model", kind.section, {k: table[k] for k in own if k in table}))
