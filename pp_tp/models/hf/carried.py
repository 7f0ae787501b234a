"""What a Hugging Face family's forward hands every layer that pp_tp gives each layer itself: the layer's own index
(Zamba2's `layer_idx`, which picks the layer's adapters inside a block shared by several layers) and the first layer's
input (Zamba's and Zamba2's `original_hidden_states`, the embedding's output every hybrid layer concatenates to its
hidden state).

Both are read off the traced forward of the small copy (handed.py) and proven there: an index is an int equal to the
layer's position in every traced layer (two layers at least), so a stage hands each of its blocks its global index;
the first layer's input is a tensor equal to the hidden state the first layer gets, in every layer, whose gradient
flows back to it unchanged (one backward on the small copy). pp_tp then carries that input beside the hidden state
across every stage boundary, `[B, S, 2, D]` (the first stage stacks the two, each layer reads both and hands the
pair on, the last stage drops the carried one before its norm), so its gradient comes back to the first stage through
the boundaries, as in the model's own forward. The self-check still proves the whole composition.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.layout import Edge, ModelDims
from pp_tp.models.hf.prologue import hidden_input
from pp_tp.models.hf.record import Record, record_of, run_until
from pp_tp.models.hf.trace import bound_arguments, same


def carries(value: Any, index: int, first: Any) -> bool:
    """Whether a traced layer argument may be one pp_tp gives the layer itself: the layer's index (`index`, its
    position in the list), or a tensor equal to the first layer's hidden input `first` (`find` proves which)."""
    if type(value) is int:
        return value == index
    return isinstance(value, torch.Tensor) and isinstance(first, torch.Tensor) and same(value, first, dtype=True)


@dataclasses.dataclass(frozen=True)
class Carried:
    """The keys a stage fills per layer: `index_keys` with the layer's global index, `stream_keys` with the first
    layer's input carried beside the hidden state (stream 1 of `[B, S, 2, D]`)."""

    index_keys: tuple[str, ...]
    stream_keys: tuple[str, ...]

    @property
    def keys(self) -> set[str]:
        return {*self.index_keys, *self.stream_keys}

    def call(self, inner: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`call_block` handing each layer its global `index` (StageModule hands it: the block's position in the layer
        list) under the keys the forward hands it, and, with a stream, its hidden state and the carried input (fresh
        copies, so no layer keeps the pair alive for its backward), the pair handed on."""

        def call_block(block: nn.Module, h: torch.Tensor, extras: tuple[Any, ...], index: int) -> torch.Tensor:
            handed = dict.fromkeys(self.index_keys, index)  # (none where none is handed)
            if not self.stream_keys:
                return inner(block, h, extras, index, **handed)
            first = h[:, :, 1]
            handed |= dict.fromkeys(self.stream_keys, first.clone())
            out = inner(block, h[:, :, 0].clone(), extras, index, **handed)
            return torch.stack([out, first], dim=2)

        return call_block

    def steps(self, steps: dict[str, Any]) -> dict[str, Any]:
        """The layout's edges and `call_block` (`layout._stream_steps`) with the carried input: the first stage
        stacks its output twice, the last drops the carried one before its own path."""
        call = self.call(steps["call_block"])
        if not self.stream_keys:
            return {**steps, "call_block": call}
        first, last = steps["first"], steps["last"]
        return {
            "first": Edge(first.modules, _Stacked(first.call)),
            "call_block": call,
            "last": Edge(last.modules, _Dropped(last.call)),
        }

    def dims(self, dims: Callable[[nn.Module], ModelDims]) -> Callable[[nn.Module], ModelDims]:
        """The layout's `dims` with two streams across boundaries where the first layer's input is carried."""
        return _TwoStreams(dims) if self.stream_keys else dims


@dataclasses.dataclass(frozen=True)
class _Stacked:
    call: Callable[..., torch.Tensor]

    def __call__(self, stage: nn.Module, ids: torch.Tensor, position_ids: Any = None) -> torch.Tensor:
        h = self.call(stage, ids, position_ids)
        return torch.stack([h, h], dim=2)


@dataclasses.dataclass(frozen=True)
class _Dropped:
    call: Callable[..., torch.Tensor]

    def __call__(self, stage: nn.Module, h: torch.Tensor, position_ids: Any = None) -> torch.Tensor:
        return self.call(stage, h[:, :, 0].contiguous(), position_ids)


@dataclasses.dataclass(frozen=True)
class _TwoStreams:
    dims: Callable[[nn.Module], ModelDims]

    def __call__(self, model: nn.Module) -> ModelDims:
        return dataclasses.replace(self.dims(model), streams=2)


def find(model: nn.Module, blocks_fqn: str, found: Any, streams: int) -> Carried:
    """What `found` (handed.Handed: the traced forward of `model`'s small copy, layers `blocks_fqn`) shows the forward
    handing every layer that pp_tp gives it itself; a first-layer input beside other streams (`streams` > 1:
    hyper-connections, per-layer inputs) is refused in one line."""
    if found is None or len(found.layers) < 2 or not found.run_once_in_order():
        return Carried((), ())
    layers = found.layers
    index_keys = tuple(sorted(k for k in layers[0] if all(_is_index(a.get(k), i) for i, a in enumerate(layers))))
    width = (found.rows, found.seq, found.config.hidden_size)
    candidates = tuple(
        sorted(
            k
            for k, v in layers[0].items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and tuple(v.shape) == width
        )
    )
    stream_keys = _first_input_keys(model, blocks_fqn, candidates) if candidates else ()
    if stream_keys and streams > 1:
        raise ConfigError(
            f"model {type(model).__name__}: its forward hands its layers the first layer's input "
            f"({stream_keys[0]!r}) beside {streams} streams of its own, which pp_tp does not carry together; "
            "register a layout for it (pp_tp.extend.register_layout)"
        )
    return Carried(index_keys, stream_keys)


def _is_index(value: Any, i: int) -> bool:
    return type(value) is int and value == i


def _first_input_keys(model: nn.Module, blocks_fqn: str, keys: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `keys` that every layer of the small copy is handed as the first layer's hidden input itself: equal
    to it, with its gradient flowing back to it unchanged (kept in the family's record)."""
    record = record_of(model)
    return record.derived(("first_input", blocks_fqn, keys), lambda: _prove(record, blocks_fqn, keys))


def _prove(record: Record, blocks_fqn: str, keys: tuple[str, ...]) -> tuple[str, ...]:
    model = record.copy()  # with autograd this time: the record's own forward kept no graph
    layers = list(model.get_submodule(blocks_fqn))
    try:
        reached = run_until(model, {layer: i for i, layer in enumerate(layers)}, input_ids=record.ids, use_cache=False)
    except Exception:  # noqa: BLE001 - a copy that does not run proves nothing (the self-check refuses it)
        return ()
    if len(reached) != len(layers):
        return ()
    seen = [reached[i] for i in range(len(layers))]
    first = hidden_input(seen[0].args, seen[0].kwargs)
    if not isinstance(first, torch.Tensor) or not first.requires_grad:
        return ()
    passed = [bound_arguments(layers[i], c.args, c.kwargs)[0] for i, c in enumerate(seen)]
    probe = torch.randn(first.shape, generator=torch.Generator().manual_seed(0), dtype=first.dtype)
    return tuple(k for k in keys if all(_is_first(p.get(k), first, probe) for p in passed))


def _is_first(value: Any, first: torch.Tensor, probe: torch.Tensor) -> bool:
    """`value` equals `first` and hands a gradient back to it unchanged."""
    if not isinstance(value, torch.Tensor) or not value.requires_grad or not same(value, first, dtype=True):
        return False
    (grad,) = torch.autograd.grad(value, first, probe, retain_graph=True, allow_unused=True)
    return grad is not None and torch.equal(grad, probe)
