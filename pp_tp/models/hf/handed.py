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
from pp_tp.models.hf.self_check import small_config
from pp_tp.models.hf.trace import bound_arguments, seeded_copy, trace


@dataclasses.dataclass(frozen=True)
class Handed:
    """Per layer, the arguments beside the hidden state by name (`**kwargs` flattened), on ids of `ids_shape`; and
    the parameterless modules run on the hidden state between the embedding and the first layer (NanoChat's norm)."""

    config: Any
    layers: tuple[dict[str, Any], ...]
    pre: tuple[str, ...]
    ids_shape: tuple[int, int]

    @property
    def rows(self) -> int:
        return self.ids_shape[0]

    @property
    def seq(self) -> int:
        return self.ids_shape[1]


_HANDED: dict[tuple[type, str, str], Handed | None] = {}


def handed(model: nn.Module, blocks: str) -> Handed | None:
    """What `model`'s family hands the layers of its list `blocks` (relative to the module holding the input
    embedding), from one traced forward of the small copy (cached); None where the copy does not run (the
    self-check then refuses the family)."""
    small = small_config(model.config)
    key = (type(model), small.to_json_string(use_diff=False), blocks)
    if key not in _HANDED:
        _HANDED[key] = _handed(type(model), small, blocks)
    return _HANDED[key]


def _handed(cls: type, small: Any, blocks: str) -> Handed | None:
    model, ids = seeded_copy(cls, small)
    base = model.get_submodule(embedding_parent(model))
    try:
        calls = trace(model, base, ids)
        layers = list(base.get_submodule(blocks))
        at = [next(i for i, c in enumerate(calls) if c.name == f"{blocks}.{k}") for k in range(len(layers))]
    except Exception:  # noqa: BLE001 - a copy that does not run is the self-check's to refuse
        return None
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
    return Handed(small, per_layer, pre, tuple(ids.shape))
