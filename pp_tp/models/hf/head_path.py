"""The modules a Hugging Face causal LM's own forward runs between its base model and its output embedding
(ModernBERT-decoder's prediction head: dense, activation, norm before the decoder Linear), found by running it.

The small copy's forward runs once (the self-check's seeded copy and ids) with a hook on each child of the causal LM
and on its output embedding; the children it calls after the base model and before the output embedding, each once,
each handed exactly what the one before returned (the base model's last hidden state first) and handing the output
embedding exactly what the last returned, are that path, in order. Anything else gives no path: the self-check then
proves the composition without one, or refuses the family in one line.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pp_tp.models.hf.discover import same
from pp_tp.models.hf.self_check import small_config
from pp_tp.models.hf.trace import Call, seeded_copy

_PATHS: dict[tuple[type, str], tuple[str, ...]] = {}


def before_head(model: nn.Module) -> tuple[str, ...]:
    """Model-relative names of the modules the causal LM runs, in order, between its base model and its output
    embedding; () where it runs none or the trace does not prove a path (cached per class and small config)."""
    small = small_config(model.config)
    key = (type(model), small.to_json_string(use_diff=False))
    if key not in _PATHS:
        _PATHS[key] = _path(type(model), small)
    return _PATHS[key]


def _path(cls: type, small: Any) -> tuple[str, ...]:
    model, ids = seeded_copy(cls, small)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    children = [(n, c) for n, c in model.named_children() if not any(m is head for m in c.modules()) or c is head]
    calls: list[Call] = []
    handles = [
        child.register_forward_hook(lambda m, a, k, o, n=name: calls.append(Call(n, a, k, o)), with_kwargs=True)
        for name, child in children
    ]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    except Exception:  # noqa: BLE001 - a copy that does not run proves no path: the self-check refuses it
        return ()
    finally:
        for handle in handles:
            handle.remove()
    names = [c.name for c in calls]
    base = next((n for n, c in children if any(m is emb for m in c.modules())), None)
    at = next((n for n, c in children if c is head), None)
    if base not in names or at not in names or len(set(names)) != len(names) or names.index(base) > names.index(at):
        return ()
    path = calls[names.index(base) + 1 : names.index(at)]
    value = _tensor(calls[names.index(base)].out)
    for call in [*path, calls[names.index(at)]]:
        given = call.args[0] if len(call.args) == 1 and not call.kwargs else None
        if not (isinstance(given, torch.Tensor) and isinstance(value, torch.Tensor) and same(given, value)):
            return ()
        value = call.out
    return tuple(c.name for c in path)


def _tensor(out: Any) -> Any:
    """A base model's last hidden state: its output's first field."""
    return out if isinstance(out, torch.Tensor) else out[0]
