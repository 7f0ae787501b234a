"""A value the base model's forward hands each layer from the previous layer's output (HY-V4's and GLM-MoE-DSA's
`prev_topk_indices`, Zaya's router states): found in the forward's source, and proven unread where no layer's
output depends on it (GLM-MoE-DSA's default, every layer with its own indexer), so a stage need not carry it.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch
from torch import nn

from pp_tp.base._torch import tree_flatten
from pp_tp.models.hf.discover import embedding_parent
from pp_tp.models.hf.record import record_of
from pp_tp.models.hf.trace import trace


def threaded_state(model: nn.Module, blocks_key: str, block: nn.Module) -> tuple[str, str, str] | None:
    """(the layer's parameter, how it is passed: its keyword or `argument i`, the value) where the base model's
    forward, in a loop over `self.<blocks_key>`, passes a layer, beside its hidden state, a value the previous layer
    returned (HY-V4: `hidden_states, topk_indices = layer(..., prev_topk_indices=topk_indices)`; Zaya positionally);
    None when it passes none (or its source cannot be read). The hidden state may go by any name (xLSTM's
    `hidden_states_chunk`)."""
    base = model.get_submodule(embedding_parent(model))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(base).forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    params = list(inspect.signature(block.forward).parameters) or [""]
    for loop in ast.walk(tree):
        if not (isinstance(loop, ast.For) and blocks_key in ast.unparse(loop.iter)):
            continue
        layer_names = {t.id for t in ast.walk(loop.target) if isinstance(t, ast.Name)}
        for node in ast.walk(loop):
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                continue
            returned = {t.id for t in ast.walk(node.targets[0]) if isinstance(t, ast.Name)}
            called = node.value.func
            layer_call = isinstance(called, ast.Name) and called.id in layer_names
            passed = [(kw.arg, kw.arg, kw.value) for kw in node.value.keywords if kw.arg]
            args = node.value.args[: len(params)] if layer_call else []  # by the parameter each binds to
            passed += [(params[i], f"argument {i + 1}", arg) for i, arg in enumerate(args)]
            for name, shown, value in passed:
                if name != params[0] and isinstance(value, ast.Name) and value.id in returned - {"hidden_states"}:
                    return name, shown, value.id
    return None


def unread(model: nn.Module, blocks_key: str, name: str) -> bool:
    """Whether no layer reads the handed value `name`: on the family's small copy every layer, called again with what
    the recorded forward (record.py) handed it but `name` None, returns exactly what it returned (every output), and
    every layer of `model` has the module tree of one of the small copy's layers (a kind the copy lacks, HY-V4's
    shared-indexer layers, is not proven)."""
    record = record_of(model)
    copy = record.model
    base = copy.get_submodule(embedding_parent(copy))
    layers = list(base.get_submodule(blocks_key))
    proven = {_kind(layer) for layer in layers}
    if any(_kind(layer) not in proven for layer in model.get_submodule(f"{embedding_parent(model)}.{blocks_key}")):
        return False
    if record.error is not None:  # a copy that does not run proves nothing unread
        return False
    try:
        calls = trace(record, embedding_parent(copy))
        by_name = {f"{blocks_key}.{k}": layer for k, layer in enumerate(layers)}
        return all(_same_without(by_name[c.name], c.args, c.kwargs, c.out, name) for c in calls if c.name in by_name)
    except Exception:  # noqa: BLE001 - a layer that cannot run without the value reads it
        return False


def _kind(layer: nn.Module) -> tuple[tuple[str, str], ...]:
    return tuple((n, type(m).__name__) for n, m in layer.named_modules())


def _same_without(layer: nn.Module, args: tuple, kwargs: dict, out: object, name: str) -> bool:
    signature = inspect.signature(layer.forward)
    bound = signature.bind(*args, **kwargs)
    if name in bound.arguments:
        bound.arguments[name] = None
    else:  # passed through the layer's **kwargs
        var = next(k for k, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD)
        bound.arguments[var] = {**bound.arguments[var], name: None}
    with torch.no_grad():
        again = layer(*bound.args, **bound.kwargs)
    before, after = tree_flatten(out)[0], tree_flatten(again)[0]
    return len(before) == len(after) and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(before, after)
    )
