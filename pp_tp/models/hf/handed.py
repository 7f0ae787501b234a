"""What a Hugging Face family's own forward hands each of its layers, read off one traced forward of its small copy:
the arguments beside the hidden state (masks, rotary tables or None, keywords passed through `**kwargs`) and the
parameterless modules it runs on the hidden state before the first layer. The block context adopts these where they
differ from its defaults; the self-check still proves the whole composition."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from pp_tp.models.hf.discover import embed_name, embedding_parent
from pp_tp.models.hf.extras import after_embed
from pp_tp.models.hf.prologue import hidden_input, replay_target
from pp_tp.models.hf.record import Call, Record, record_of
from pp_tp.models.hf.trace import bound_arguments, trace


@dataclasses.dataclass(frozen=True)
class Handed:
    """Per layer, the arguments beside the hidden state by name (`**kwargs` flattened), on ids of `ids_shape`; and
    the parameterless modules run on the hidden state between the embedding and the first layer (NanoChat's norm)."""

    config: Any
    layers: tuple[dict[str, Any], ...]
    pre: tuple[str, ...]
    ids_shape: tuple[int, int]
    runs: tuple[int, ...] = ()  # the layers' indices in the order the forward runs them (on ids alone)
    changed_before: str | None = None  # where the embedding's output was changed outside any module (CTRL's scale)

    def run_once_in_order(self) -> bool:
        """Whether the forward runs each layer once, in order: not looped (Dory), none skipped (Mllama's
        cross-attention layers on text alone)."""
        return self.runs == tuple(range(len(self.runs))) and len(self.runs) == len(self.layers)

    @property
    def rows(self) -> int:
        return self.ids_shape[0]

    @property
    def seq(self) -> int:
        return self.ids_shape[1]


def handed(model: nn.Module, blocks: str) -> Handed | None:
    """What `model`'s family hands the layers of its list `blocks` (relative to the module holding the input
    embedding), read off its recorded forward (record.py); None where the copy does not run (the self-check then
    refuses the family)."""
    record = record_of(model)
    return record.derived(("handed", blocks), lambda: _handed(record, blocks))


def _handed(record: Record, blocks: str) -> Handed | None:
    model, ids, small = record.model, record.ids, record.small
    base = model.get_submodule(embedding_parent(model))
    try:
        layers = list(base.get_submodule(blocks))
    except Exception:  # noqa: BLE001 - a copy that does not run is the self-check's to refuse
        return None
    if record.error is not None:
        return None
    calls = trace(record, embedding_parent(model))
    names = {f"{blocks}.{k}": k for k in range(len(layers))}
    runs = tuple(names[c.name] for c in calls if c.name in names)
    if sorted(runs) != list(range(len(layers))):
        return Handed(small, (), (), tuple(ids.shape), runs)  # layout.py refuses it
    at = [next(i for i, c in enumerate(calls) if c.name == name) for name in names]
    per_layer = tuple(bound_arguments(layer, calls[i].args, calls[i].kwargs)[0] for layer, i in zip(layers, at))
    embed = embed_name(model, base)
    pre = tuple(
        c.name
        for c in calls[: min(at)]
        if c.name != embed
        and not any(True for _ in base.get_submodule(c.name).parameters())
        and len(c.args) == 1
        and not c.kwargs
        and isinstance(c.args[0], torch.Tensor)
        and c.args[0].is_floating_point()
        and c.args[0].shape[:2] == ids.shape
        and isinstance(c.out, torch.Tensor)
    )
    changed = _changed_outside(model, calls[: at[0] + 1], embed, ids, embedding_parent(model))
    return Handed(small, per_layer, pre, tuple(ids.shape), runs, changed)


def _changed_outside(model: nn.Module, calls: list[Call], embed: str, ids: torch.Tensor, prefix: str) -> str | None:
    """The first call (the first layer last in `calls`) whose hidden-state input is not the embedding's output as
    the modules before it left it (each module on the hidden state replacing it, a position embedding added, the
    config's own transform first: extras.after_embed, or the forward's own code the first stage replays:
    prologue.replay_target): the forward changed it outside any module in a way pp_tp does not reproduce; None where
    nothing was."""
    start = next((i for i, c in enumerate(calls) if c.name == embed), None)
    if start is None or not isinstance(calls[start].out, torch.Tensor):
        return None
    replayed = replay_target(model, calls, embed, ids, prefix)
    after = after_embed(model.config)
    h = after(calls[start].out) if after is not None else calls[start].out
    for call in (c for c in calls[start + 1 :] if c.kind != "wrapper"):  # a wrapper returns what it ran
        first = hidden_input(call.args, call.kwargs)
        hidden = isinstance(first, torch.Tensor) and first.is_floating_point() and first.shape == h.shape
        h = first if call.name == replayed else h
        if call is calls[-1] or (hidden and isinstance(call.out, torch.Tensor) and call.out.shape == h.shape):
            if not (hidden and torch.allclose(first, h, rtol=1e-6, atol=1e-6)):
                return call.name
            h = call.out
        elif isinstance(out := call.out, torch.Tensor) and out.is_floating_point() and out.shape[-2:] == h.shape[-2:]:
            h = h + out  # a learned position embedding (GPT-2's wpe), added
    return None
