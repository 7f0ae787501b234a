"""One traced forward of a Hugging Face family's small copy: the calls of the modules around its layers and of each
layer, with their arguments and outputs. discover.py reads the structure off it, handed.py what each layer is handed,
on the same seeded copy and ids."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import nn

ROWS, SEQ = 2, 6  # the traced ids' shape


@dataclasses.dataclass
class Call:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any
    kind: str = "module"  # "module", "layer" (an element of a layer list) or "wrapper" (holds what is traced)


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


def trace(model: nn.Module, base: nn.Module, ids: torch.Tensor) -> list[Call]:
    """The calls of `base`'s children (through wrappers) and of their layer lists' elements, in the order they
    return, on one forward of `model`."""
    calls: list[Call] = []
    handles = []
    for name, module, kind in _targets(base, model.get_input_embeddings()):
        hook = lambda m, a, k, o, name=name, kind=kind: calls.append(Call(name, a, k, o, kind))  # noqa: E731
        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return calls


def bound_arguments(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """A layer call's arguments by name, those passed through its `**kwargs` included, the first (the hidden state)
    left out; and the names that came through `**kwargs`."""
    signature = inspect.signature(block.forward)
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


def seeded_copy(cls: type, small: Any) -> tuple[nn.Module, torch.Tensor]:
    """The family's small copy with seeded weights (eval, fp32, the caller's RNG untouched) and seeded input ids."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(small).to(torch.float32).eval()
    return model, torch.randint(0, small.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
