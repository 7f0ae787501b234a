"""Per-layer inputs (Gemma 4) across stage boundaries.

The base model's forward computes, once before its layers, a `[B, S, L, P]` tensor from the token ids and the
embedding's output with two methods of its own (`get_per_layer_inputs`, `project_per_layer_inputs`, whose weights lie
beside embedding, layers and norm) and hands layer i slice i as `per_layer_input`. pp_tp keeps those weights on the
first stage, which runs the model's own two methods right after the embedding and packs their output beside the hidden
state into one plain `[B, S, 1 + c, D]` tensor (c streams of the hidden width D hold the L * P values, zero-padded):
it crosses every stage boundary whole, each layer reads its slice and hands the rest on, and the last stage drops it
before its norm. Every weight lives on one stage and gets its whole gradient back through the boundaries; the
self-check proves the composition equal to the model's own forward, or refuses the family.
"""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pp_tp.errors import ConfigError

_METHODS = ("get_per_layer_inputs", "project_per_layer_inputs")


def streams(model: nn.Module, base: str) -> int:
    """Streams of the hidden width the packed boundary tensor holds: 1 + those the per-layer inputs fill, or 1."""
    config = model.config
    if not _has_methods(type(model.get_submodule(base))):
        return 1
    width = config.num_hidden_layers * (getattr(config, "hidden_size_per_layer_input", 0) or 0)
    return 1 + math.ceil(width / config.hidden_size)


def _has_methods(cls: type) -> bool:
    return all(callable(getattr(cls, name, None)) for name in _METHODS)


def _read_names(cls: type) -> set[str]:
    """The `self.<name>` attributes the two methods read (their source), else empty."""
    names: set[str] = set()
    for method in _METHODS:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, method))))
        except (OSError, TypeError, SyntaxError):
            return set()
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "self"}
    return names


@dataclass(frozen=True)
class PerLayerInputs:
    """How a stage computes, carries and hands on the per-layer inputs (see the module docstring)."""

    base: str  # the base model's FQN
    cls: type  # its class, whose two methods compute the inputs
    modules: tuple[str, ...]  # base-relative names of the modules the methods read
    attrs: dict[str, Any]  # the plain attributes they read (config, scales), as the base model holds them
    width: int  # P, one layer's input width
    dim: int  # D, the hidden width

    def compute(self, stage: nn.Module, ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """`[B, S, L, P]` by the model's own methods, bound to the stage's modules (the stage holds them all)."""
        held = {name: stage.get_submodule(f"{self.base}.{name}") for name in self.modules}
        me = types.SimpleNamespace(**self.attrs, **held)
        return self.cls.project_per_layer_inputs(me, embeds, self.cls.get_per_layer_inputs(me, ids, embeds))

    def pack(self, h: torch.Tensor, per_layer: torch.Tensor) -> torch.Tensor:
        """The hidden state `[B, S, D]` and the per-layer inputs as one `[B, S, 1 + c, D]` tensor."""
        flat = per_layer.flatten(2)
        pad = (-flat.shape[-1]) % self.dim
        flat = torch.nn.functional.pad(flat, (0, pad)) if pad else flat
        return torch.cat([h.unsqueeze(2), flat.unflatten(-1, (-1, self.dim))], dim=2)

    def call(self, inner: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`call_block` over the packed tensor: the layer gets the hidden state and its own slice (fresh copies, so no
        layer keeps the packed tensor alive for its backward) and returns the new hidden state, packed again."""

        def call_block(
            block: nn.Module, h: torch.Tensor, extras: tuple[Any, ...], index: int, **handed: Any
        ) -> torch.Tensor:
            carried = h[:, :, 1:]
            mine = carried.flatten(2)[..., index * self.width : (index + 1) * self.width].clone()
            out = inner(block, h[:, :, 0].clone(), extras, index, per_layer_input=mine, **handed)
            return torch.cat([out.unsqueeze(2), carried], dim=2)

        return call_block

    def embed_call(self, embed: str, after: Callable | None, run: tuple[str, ...]) -> Callable[..., torch.Tensor]:
        """The first stage's path: the embedding, what the forward does to its output before the layers (`after`, the
        modules `run`), and the per-layer inputs from the ids and the embedding's output, packed beside it."""

        def call(stage: nn.Module, ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
            embeds = stage.get_submodule(embed)(ids)
            h = after(embeds) if after is not None else embeds
            for name in run:
                h = stage.get_submodule(name)(h)
            return self.pack(h, self.compute(stage, ids, embeds))

        return call

    @staticmethod
    def drop(h: torch.Tensor) -> torch.Tensor:
        """The last stage's step before its norm: the hidden state alone."""
        return h[:, :, 0].contiguous()


def candidates(model: nn.Module, base: str, weighted: list[str]) -> list[str]:
    """Those of `weighted` (the base model's weighted modules outside embedding/layers/norm) that the base model's two
    methods read, where it has them and its config sets `hidden_size_per_layer_input`; empty otherwise."""
    cls = type(model.get_submodule(base))
    if not (_has_methods(cls) and getattr(model.config, "hidden_size_per_layer_input", 0)):
        return []
    names = _read_names(cls)
    return [w for w in weighted if w in names]


def find(model: nn.Module, base: str, found: Any, held: list[str]) -> PerLayerInputs | None:
    """The per-layer inputs the modules `held` (`candidates`) compute, where the traced forward (`found`) hands every
    layer a `per_layer_input` of `[rows, seq, P]`; refused in one line where it does not; None where `held` is empty."""
    if not held:
        return None
    module = model.get_submodule(base)
    cls, config = type(module), model.config
    shape = (*found.ids_shape, found.config.hidden_size_per_layer_input) if found is not None else ()
    if (
        found is None
        or not found.layers
        or not all(_sized(layer.get("per_layer_input"), shape) for layer in found.layers)
    ):
        raise ConfigError(
            f"model {type(model).__name__}: {base}.{held[0]} computes per-layer inputs its forward does not hand every "
            "layer as `per_layer_input`; register a layout for it"
        )
    names = _read_names(cls)
    used = tuple(sorted(n for n, _ in module.named_children() if n in names))
    attrs = {n: v for n, v in vars(module).items() if n in names and not isinstance(v, nn.Module)}
    return PerLayerInputs(base, cls, used, attrs, config.hidden_size_per_layer_input, config.hidden_size)


def _sized(value: Any, shape: tuple[int, ...]) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and tuple(value.shape) == shape
