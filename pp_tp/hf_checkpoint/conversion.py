"""On-disk keys -> the model's tensors, through transformers' own conversion mapping (never a table of ours).

transformers renames checkpoint keys and converts them on load (`transformers.conversion_mapping`: Mixtral's
`block_sparse_moe.experts.3.w1.weight` becomes part of `mlp.experts.gate_up_proj`) with the same
`rename_source_key` used here; each converter's operations (MergeModulelist, Concatenate, Transpose) become a
`views.View` that is read box by box per rank. An operation with no per-rank reading is refused by name, and so
is a missing expert or one of the wrong shape, before any collective. `Reverter` applies transformers'
reverse conversion (`revert_weight_conversion`) to each tensor `save_pretrained` writes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.hf_checkpoint.views import Cat, Leaf, Stack, Transposed, View

_REWRITE = "load it with transformers' from_pretrained and save its state_dict with safetensors"


def conversions(model: nn.Module) -> list:
    """transformers' weight transforms for `model` (what from_pretrained applies), or [] for a non-HF model."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # pragma: no cover - transformers is a dependency of the HF models only
        return []
    return get_model_conversion_mapping(model) if isinstance(model, PreTrainedModel) else []


def _index(key: str, pattern: str) -> int | None:
    """The expert number `*` stands for in `key` (matched by the source pattern), if it is one."""
    m = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    return int(m.group(1)) if m and m.groups() else None


def build_views(
    path: str, leaves: dict[str, Leaf], model: nn.Module, known: dict[str, tuple[int, ...]]
) -> tuple[dict[str, View], list[str]]:
    """(model key -> its view, on-disk keys no model key takes). `known`: every model key (aliases included) and
    its shape. Keys are renamed exactly as `from_pretrained` renames them (in its order: natural key order)."""
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        apply_renamings,
        dot_natural_key,
        rename_source_key,
    )

    transforms = conversions(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None) if transforms else None
    views: dict[str, View] = {}
    groups: dict[str, tuple] = {}
    unused = []
    for key in sorted(leaves, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, known) if transforms else (key, None)
        if target not in known and key in known:
            target, pattern = key, None
        if target not in known:
            unused.append(key)
        elif pattern is None:
            if target in views:
                raise ConfigError(
                    f"checkpoint {path!r}: {key!r} and {views[target].key!r} both load into {target!r} "
                    "(transformers' key renaming); keep one of them"
                )
            views[target] = leaves[key]
        else:
            converter, got = groups.setdefault(target, (by_pattern[pattern], {}))
            got.setdefault(pattern, []).append((_index(apply_renamings(key, renamings), pattern), leaves[key]))
    for target, (converter, got) in groups.items():
        views[target] = _converted(path, target, converter, got, known[target])
    return views, unused


def _converted(path: str, target: str, converter, got: dict, want: tuple[int, ...]) -> View:
    """The view transformers' `converter` makes of the collected tensors (pattern -> [(expert, leaf)])."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose

    state: dict[str, list[View]] = {p: _in_order(path, target, p, items) for p, items in got.items()}
    for op in converter.operations:
        kind = type(op)
        if kind is MergeModulelist:
            state = {p: [_stacked(target, op.dim, parts)] for p, parts in state.items()}
        elif kind is Concatenate:
            parts = [v for p in converter.source_patterns for v in state.get(p, [])]
            state = {"": [_concatenated(target, op.dim, parts)]}
        elif kind is Transpose and len(state) == 1 and len(next(iter(state.values()))) == 1:
            (v,) = next(iter(state.values()))
            keep = op.check_dims and v.shape == want
            state = {"": [v if keep else Transposed(op.dim0, op.dim1, v)]}
        else:
            raise ConfigError(
                f"checkpoint {path!r}: {target!r} needs transformers' {kind.__name__} conversion of "
                f"{converter.source_patterns}, which pp_tp cannot read per rank; {_REWRITE}"
            )
    outs = [v for vs in state.values() for v in vs]
    if len(outs) != 1:
        raise ConfigError(
            f"checkpoint {path!r}: {target!r} is made of {len(outs)} tensors after transformers' conversion "
            f"{[type(o).__name__ for o in converter.operations]}; pp_tp reads one-to-one and many-to-one only"
        )
    view = outs[0]
    if isinstance(view, Stack) and view.shape[1:] == want[1:] and view.shape[0] < want[0]:
        raise _missing(path, target, len(view.parts), converter.source_patterns[0])
    if isinstance(view, Cat) and all(isinstance(p, Stack) for p in view.parts) and view.shape[0] < want[0]:
        raise _missing(path, target, view.shape[0], converter.source_patterns[0])
    return view


def _missing(path: str, target: str, n: int, pattern: str) -> ConfigError:
    return ConfigError(
        f"checkpoint {path!r} is missing expert {n} of {target!r} (no {pattern.replace('*', str(n))!r} "
        "on disk); give every expert's weights"
    )


def _in_order(path: str, target: str, pattern: str, items: list[tuple[int | None, Leaf]]) -> list[View]:
    """The tensors of one source pattern by expert number; a gap is a missing expert (one line)."""
    if any(i is None for i, _ in items):
        return [leaf for _, leaf in items]
    items = sorted(items, key=lambda t: t[0])
    for n, (i, _) in enumerate(items):
        if i != n:
            raise _missing(path, target, n, pattern)
    return [leaf for _, leaf in items]


def _stacked(target: str, dim: int, parts: list[View]) -> View:
    first = parts[0]
    for p in parts[1:]:
        if p.shape != first.shape:
            raise _mismatch(target, p, first)
    return Stack(dim, tuple(parts))


def _concatenated(target: str, dim: int, parts: list[View]) -> View:
    first = parts[0]
    rest = lambda shape: shape[:dim] + shape[dim + 1 :]  # noqa: E731 - the shape off the concatenated dim
    for p in parts[1:]:
        if rest(p.shape) != rest(first.shape):
            raise _mismatch(target, p, first)
    return Cat(dim, tuple(parts))


def _mismatch(target: str, bad: View, first: View) -> ConfigError:
    leaf = bad if isinstance(bad, Leaf) else _first_leaf(bad)
    what = f"{leaf.file}: {leaf.key!r} has shape {leaf.shape}" if bad is leaf else f"{leaf.file}: {leaf.key!r}'s group"
    return ConfigError(
        f"checkpoint {what}, unlike {_first_leaf(first).key!r} {_first_leaf(first).shape} that {target!r} "
        "packs with it; check config.json against the weights"
    )


def _first_leaf(view: View) -> Leaf:
    while not isinstance(view, Leaf):
        view = view.part if isinstance(view, Transposed) else view.parts[0]
    return view


class Reverter:
    """transformers' reverse conversion (what its save_pretrained writes) of one model tensor at a time."""

    def __init__(self, config):
        self.model = None
        if config is None or not hasattr(config, "model_type"):
            return
        from transformers import AutoModelForCausalLM

        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        except (ValueError, KeyError):  # a config AutoModelForCausalLM does not know: written as it is
            return
        self.model = model if conversions(model) else None

    def convert(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """{on-disk key: tensor} for the model tensor `key` (meta tensors give the names and shapes)."""
        if self.model is None:
            return {key: tensor}
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self.model, {key: tensor})

    def plan(self, owned: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> dict[str, dict[str, tuple]]:
        """model key -> {on-disk key: shape}; a disk key made of two model tensors is refused (one line)."""
        out: dict[str, dict[str, tuple]] = {}
        seen: dict[str, str] = {}
        for key, shape, dtype in owned:
            names = self.convert(key, torch.empty(shape, dtype=dtype, device="meta"))
            for name in names:
                if seen.setdefault(name, key) != key:
                    raise ConfigError(
                        f"save_pretrained: transformers' reverse conversion writes {name!r} from both {seen[name]!r} "
                        f"and {key!r}; pp_tp writes one model tensor at a time"
                    )
            out[key] = {n: tuple(t.shape) for n, t in names.items()}
        return out
