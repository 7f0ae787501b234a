"""Layer arguments a family's forward computes per layer type from the position ids (Beam's `attention_scaling`, the
query scale of its NoPE full-attention layers; None for its sliding ones), computed per microbatch by the family's
own forward: a seeded small copy run on the stage's position ids, stopped once the first layer of each type has been
handed them. Adopted only where that copy reproduces what the traced copy handed every layer of the type, on other
weights and token ids; an argument it does not reproduce is refused in one line."""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.models.hf.discover import same
from pp_tp.models.hf.record import run_until
from pp_tp.models.hf.trace import bound_arguments

_MEMO = 8  # distinct position-id sets remembered
_MISSING = object()  # a type the stand-in did not reach: equal to no value


class PositionArgs:
    """Per layer type, the arguments of `keys` the family's own forward hands that type's layers for given position
    ids (None where it hands that type none)."""

    def __init__(self, cls: type, config: Any, types: list[str], keys: tuple[str, ...]):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)  # other weights than the traced copy's: what is adopted does not depend on them
            self.model = cls(config).to(torch.float32).eval()
        self.keys, self.vocab = keys, config.vocab_size
        layers = next(m for m in self.model.modules() if isinstance(m, nn.ModuleList) and len(m) == len(types))
        self.first = {t: layers[types.index(t)] for t in dict.fromkeys(types)}
        self._dtype = torch.float32
        # The last few microbatches' answers by (rows, dtype, device, position ids): a step's microbatches share their
        # position ids, so the stand-in runs once per distinct set, not once per microbatch.
        self._memo: OrderedDict[tuple[Any, ...], dict[str, dict[str, Any]]] = OrderedDict()

    def __call__(self, position_ids: torch.Tensor, rows: int, dtype: torch.dtype) -> dict[str, dict[str, Any]]:
        """{layer type: {key: value}} for microbatches of `rows` rows at `position_ids` (values moved to their
        device)."""
        cpu = position_ids.cpu()
        key = (rows, dtype, position_ids.device, tuple(cpu.shape), cpu.numpy().tobytes())
        if key not in self._memo:
            self._memo[key] = self._run(cpu, rows, dtype, position_ids.device)
            if len(self._memo) > _MEMO:
                self._memo.popitem(last=False)
        return self._memo[key]

    def _run(self, position_ids: torch.Tensor, rows: int, dtype: torch.dtype, device: torch.device) -> dict:
        """One run of the stand-in on CPU `position_ids`, stopped once every layer type's first layer is reached."""
        if dtype != self._dtype:
            self.model.to(dtype)
            self._dtype = dtype
        positions = position_ids.expand(rows, -1) if position_ids.shape[0] == 1 else position_ids
        ids = torch.randint(0, self.vocab, positions.shape, generator=torch.Generator().manual_seed(1))
        stops = {m: t for t, m in self.first.items()}
        with torch.no_grad():
            reached = run_until(self.model, stops, input_ids=ids, position_ids=position_ids, use_cache=False)
        got = {t: bound_arguments(c.module, c.args, c.kwargs)[0] for t, c in reached.items()}
        moved = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        return {t: {k: moved(a.get(k)) for k in self.keys} for t, a in got.items()}


def position_args(
    model: nn.Module, found: Any, types: list[str], handled: set[str]
) -> tuple[PositionArgs | None, tuple[str, ...]]:
    """The stand-in for the tensors `found` shows the forward handing layers that pp_tp does not supply (`handled`)
    and that are equal for every layer of a type, with those keys; (None, ()) where there are none. One the stand-in
    does not reproduce on the traced shape is refused in one line where the forward hands it per layer type
    (None to some types); dropped otherwise (per-layer inputs: per_layer_inputs.py hands them)."""
    keys = sorted(
        {k for layer in found.layers for k, v in layer.items() if isinstance(v, torch.Tensor) and k not in handled}
    )
    by_type = {t: found.layers[types.index(t)] for t in dict.fromkeys(types)}  # each type's first layer
    keys = tuple(k for k in keys if all(same(by_type[t].get(k), layer.get(k)) for t, layer in zip(types, found.layers)))
    if not keys:
        return None, ()
    try:
        stand_in = PositionArgs(type(model), _stand_in_config(type(model), model.config, found.config), types, keys)
        got = stand_in(torch.arange(found.seq).unsqueeze(0), found.rows, torch.float32)
    except Exception:  # noqa: BLE001 - a copy that does not run reproduces nothing: refused below
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
    return stand_in, keys


def _stand_in_config(cls: type, full: Any, small: Any) -> Any:
    """The small config with every value it changed back at the full model's where that changes no parameter's shape
    (Beam's sliding window; per-layer lists stay the small copy's): the stand-in's arguments are then the full
    model's wherever they depend on such a value. One that depends on a width the small copy shrinks (none known) is
    not covered; `position_args` still requires the stand-in to reproduce the traced small copy."""
    config = copy.deepcopy(small)
    shapes = _shapes(cls, config)
    for key, value in full.to_dict().items():
        if key in small.to_dict() and getattr(small, key, None) != value and not isinstance(value, (dict, list, tuple)):
            trial = copy.deepcopy(config)
            try:
                setattr(trial, key, value)
                if _shapes(cls, trial) == shapes:
                    config = trial
            except Exception:  # noqa: BLE001 - a value the small copy cannot take stays the small one
                continue
    return config


def _shapes(cls: type, config: Any) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(p.shape) for k, p in cls(config).named_parameters()}
