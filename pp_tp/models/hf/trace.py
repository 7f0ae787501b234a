"""The view of a family's recorded forward (record.py) that discover.py and handed.py read: the calls of the modules
around its layers and of each layer, with their arguments and outputs."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from pp_tp.models.hf.record import Call, Record


def _holds(module: nn.Module, emb: nn.Module, lists: bool) -> bool:
    """Whether `module` holds the input embedding or (with `lists`) a layer list: a wrapper whose children are
    traced instead."""
    return any(m is emb or (lists and isinstance(m, nn.ModuleList)) for m in module.modules())


def _targets(base: nn.Module, emb: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module, str]]:
    """(name, module, kind) of what the trace hooks under `base`: its children; the elements of a layer list; and,
    through a wrapper (BERT's `embeddings` around the word embedding; where `base` holds no layer list itself,
    `encoder` around `layer`), the wrapper's children the same way."""
    out = []
    lists = not any(isinstance(child, nn.ModuleList) for child in base.children())
    for name, child in base.named_children():
        name = f"{prefix}{name}"
        if isinstance(child, nn.ModuleList):
            out += [(f"{name}.{i}", m, "layer") for i, m in enumerate(child)]
        elif child is not emb and _holds(child, emb, lists):
            out += [(name, child, "wrapper"), *_targets(child, emb, f"{name}.")]
        else:
            out.append((name, child, "module"))
    return out


def trace(record: Record, base_name: str) -> list[Call]:
    """The calls of the record's eval forward to the children (through wrappers) of its module `base_name` and to
    their layer lists' elements, in the order they returned, named relative to that module."""
    base = record.model.get_submodule(base_name)
    targets: dict[int, list[tuple[str, str]]] = {}
    for name, module, kind in _targets(base, record.model.get_input_embeddings()):
        targets.setdefault(id(module), []).append((name, kind))
    return [
        Call(name, c.module, c.args, c.kwargs, c.out, kind)
        for c in record.calls
        for name, kind in targets.get(id(c.module), ())
    ]


def bound_arguments(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """A layer call's arguments by name, those passed through its `**kwargs` included, the first (the hidden state)
    left out; and the names that came through `**kwargs`. The class's forward: a stand-in's layer passes its input on
    with a forward of its own (prologue.py)."""
    signature = inspect.signature(type(block).forward.__get__(block))
    bound = signature.bind(*args, **kwargs).arguments
    passed: dict[str, Any] = {}
    via_kwargs: set[str] = set()
    for name, value in list(bound.items())[1:]:
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            passed.update(value)
            via_kwargs.update(value)
        else:
            passed[name] = value
    return passed, via_kwargs


def same(a: Any, b: Any, dtype: bool = False) -> bool:
    """Equal traced values: both None, equal tensors, or dicts of equal values (masks per layer type, computed
    layer arguments); with `dtype`, tensors of one dtype only (torch.equal promotes)."""
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict)
            and isinstance(b, dict)
            and a.keys() == b.keys()
            and all(same(a[k], b[k], dtype) for k in a)
        )
    if a is None or b is None:
        return a is b
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and (not dtype or a.dtype == b.dtype) and torch.equal(a, b)
    return False
