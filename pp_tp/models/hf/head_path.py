"""The modules a Hugging Face causal LM's own forward runs between its base model and its output embedding
(ModernBERT-decoder's prediction head: dense, activation, norm before the decoder Linear), found by running it.

The family's recorded forward (record.py) shows the calls of each child of the causal LM and of its output
embedding; the children it calls after the base model and before the output embedding, each once,
each handed exactly what the one before returned (the base model's last hidden state first) and handing the output
embedding exactly what the last returned, are that path, in order. Anything else gives no path: the self-check then
proves the composition without one, or refuses the family in one line.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pp_tp.models.hf.record import Call, Record, record_of
from pp_tp.models.hf.trace import same


def before_head(model: nn.Module) -> tuple[str, ...]:
    """Model-relative names of the modules the causal LM runs, in order, between its base model and its output
    embedding; () where it runs none or the recorded forward (record.py) does not prove a path."""
    record = record_of(model)
    return record.derived("head_path", lambda: _path(record))


def _path(record: Record) -> tuple[str, ...]:
    if record.error is not None:  # a copy that does not run proves no path: the self-check refuses it
        return ()
    model = record.model
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    children = [(n, c) for n, c in model.named_children() if not any(m is head for m in c.modules()) or c is head]
    named: dict[int, list[str]] = {}
    for name, child in children:
        named.setdefault(id(child), []).append(name)
    calls = [Call(n, c.module, c.args, c.kwargs, c.out) for c in record.calls for n in named.get(id(c.module), ())]
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
