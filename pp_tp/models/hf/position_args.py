"""Layer arguments a family's forward computes per layer type from the position ids (Beam's `attention_scaling`, the
query scale of its NoPE full-attention layers; None for its sliding ones), computed per microbatch by the prologue
replay (prologue.py) of the model's own config. Adopted only where the same replay of the small copy's config
reproduces what the traced copy handed every layer of the type, on the traced shape; an argument it does not reproduce
is refused in one line."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.models.hf.prologue import LayerArgs, Prologue, prologue_of
from pp_tp.models.hf.record import record_of
from pp_tp.models.hf.trace import same

_MISSING = object()  # a type the replay did not reach: equal to no value


def position_args(
    model: nn.Module, found: Any, types: list[str], handled: set[str]
) -> tuple[LayerArgs | None, tuple[str, ...]]:
    """The replay of the tensors `found` shows the forward handing layers that pp_tp does not supply (`handled`) and
    that are equal for every layer of a type, with those keys; (None, ()) where there are none. One the replay of the
    small config does not reproduce on the traced shape is refused in one line where the forward hands it per layer
    type (None to some types); dropped otherwise (per-layer inputs: per_layer_inputs.py hands them)."""
    keys = sorted(
        {k for layer in found.layers for k, v in layer.items() if isinstance(v, torch.Tensor) and k not in handled}
    )
    by_type = {t: found.layers[types.index(t)] for t in dict.fromkeys(types)}  # each type's first layer
    keys = tuple(k for k in keys if all(same(by_type[t].get(k), layer.get(k)) for t, layer in zip(types, found.layers)))
    if not keys:
        return None, ()
    # The layer list: the small copy's of `types`' length (the traced one; a wrong pick reproduces nothing: refused).
    traced = record_of(model).model
    lists = (n for n, m in traced.named_modules() if isinstance(m, nn.ModuleList) and len(m) == len(types))
    blocks = next(lists, None)
    try:
        small = LayerArgs(Prologue(type(model), found.config, blocks), keys, True)
        got = small(torch.arange(found.seq).unsqueeze(0), found.rows, torch.float32)
    except Exception:  # noqa: BLE001 - a replay that does not run reproduces nothing: refused below
        got = {}
    missed = {k for k in keys for t, want in by_type.items() if not same(got.get(t, {}).get(k, _MISSING), want.get(k))}
    per_type = [k for k in sorted(missed) if any(a.get(k) is None for a in by_type.values())]
    for kind, key in ((t, k) for k in per_type for t in by_type if by_type[t].get(k) is not None):
        # None for other layer types: handed per type, not something pp_tp hands otherwise (per-layer inputs)
        raise ConfigError(
            f"model {type(model).__name__}: its forward hands its {kind!r} layers {key!r}, which pp_tp does not compute"
        )
    keys = tuple(k for k in keys if k not in missed)
    if not keys:
        return None, ()
    return LayerArgs(prologue_of(model, blocks), keys, True), keys
