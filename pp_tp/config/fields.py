"""Per-field checks driven by the schema: types (from the dataclass annotations), bounds and allowed strings."""

from __future__ import annotations

import difflib
import functools
import json
import keyword
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any, TypeVar

from pp_tp.config.kinds import DATA_SOURCES, MODEL_KINDS
from pp_tp.config.schema import BOUNDS, CHOICES
from pp_tp.errors import ConfigError

Section = TypeVar("Section")

_TOML_TYPE_NAMES = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}


def checked(section: str, obj: Section) -> Section:
    """A copy of one section with every field type-checked (int widened to float), bounded and in its set."""
    types_ = hints(type(obj))
    values = {
        f.name: _typed(f"{section}.{toml_key(f.name)}", getattr(obj, f.name), types_[f.name]) for f in fields(obj)
    }
    for key, low, inclusive in BOUNDS.get(section, ()):
        if key in values:  # a model kind's own section is checked under "model" too, with its own bounds
            _check_bound(f"{section}.{key}", values[key], low, inclusive)
    for key, choices in _choices(section).items():
        if isinstance(values.get(key), str) and values[key] not in choices:
            raise ConfigError(
                f"{section}.{key} = {values[key]!r} is not one of {', '.join(choices)}"
                f"{did_you_mean(values[key], choices, repr)}; set {section}.{key} to one of them"
            )
    return type(obj)(**values)


def _choices(section: str) -> dict[str, tuple[str, ...]]:
    """The fixed sets of schema.CHOICES and the open registries' names (model.kind, data.source) as they are now."""
    registered = {"model": {"kind": tuple(MODEL_KINDS)}, "data": {"source": tuple(DATA_SOURCES)}}
    return {**CHOICES.get(section, {}), **registered.get(section, {})}


def toml_key(name: str) -> str:
    """A field's TOML key: a trailing underscore escapes a Python keyword (the field `async_` is TOML `async`)."""
    return name[:-1] if name.endswith("_") and keyword.iskeyword(name[:-1]) else name


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _typed(key: str, value: Any, hint: Any) -> Any:
    if not _matches(value, hint):
        raise ConfigError(
            f"{key} = {toml_value(value)} has type {_type_name(type(value))}; "
            f"set {key} to a value of type {_type_name(hint)}"
        )
    return float(value) if hint is float else value


def _matches(value: Any, hint: Any) -> bool:
    """isinstance against a field annotation: unions, list[...], bool is not an int, int passes as float."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
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


def did_you_mean(word: str, options: Iterable[str], show: Callable[[str], str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {show(close[0])}?)" if close else ""


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)
