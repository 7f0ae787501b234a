"""A Hugging Face block's mixer beyond softmax attention (linear attention, state-space, indexed attention): the
mask each layer type gets, and which modules tensor parallelism leaves whole on every TP rank.

Masks come from transformers' own table, `masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING` (what `generate`
builds per layer type): linear-attention and conv layers get the recurrent (padding) mask, indexed attention the
materialized causal mask, a hybrid layer a dict of its masks. A family that declares its own
`create_masks_for_generate` gives its layers what that returns where the table lacks one of its layer types
(Nemotron-H's MLP and MoE layers, which take no mask).
A layer type neither knows is refused in one line naming it. The self-check still proves every composition.

A mixer pp_tp cannot split by heads runs whole on every TP rank: its input is the replicated activation, so every
rank computes the same output and the same parameter gradients (exact, no communication, its weights held whole).
`whole_on_tp` names them and what they hold, for the startup report.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.layout import ModelLayout
from pp_tp.parallel.tensor_parallel import block_plan, verify
from pp_tp.parallel.tp_styles import TP_STYLES

MaskFn = Callable[..., Any]
FULL = "full_attention"
_CROSS = "encoder_attention_mask"


def mask_without_cache(mask_fn: MaskFn) -> dict[str, None]:
    """No KV cache; transformers >= 5.24 names that argument `cache` (`past_key_values` before)."""
    return {"cache": None} if "cache" in inspect.signature(mask_fn).parameters else {"past_key_values": None}


def _family_masks(model: nn.Module) -> MaskFn | None:
    """The family's own `create_masks_for_generate` (a static method of its class), None where it declares none."""
    fn = inspect.getattr_static(type(model), "create_masks_for_generate", None)
    return fn.__func__ if isinstance(fn, staticmethod) else None


class LayerMasks:
    """Per layer type, the mask (or dict of masks) the family's forward hands a layer of that type."""

    def __init__(self, model: nn.Module, types: Iterable[str]):
        from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING as MAPPING

        self.types = sorted(set(types))
        unknown = [t for t in self.types if t not in MAPPING]
        self.family = _family_masks(model) if unknown else None
        if unknown and self.family is None:
            raise ConfigError(
                f"model {type(model).__name__}: config.layer_types has {unknown[0]!r} layers, which transformers' "
                "masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING does not know and the family declares no "
                "create_masks_for_generate; pp_tp cannot tell which mask they take (register a layout for it: "
                "pp_tp.extend.register_layout)"
            )
        self.makers = {t: MAPPING[t] for t in self.types} if self.family is None else {}
        self.separate = _separate_mixer_mask(model)

    def build(self, config: Any, h: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        """Layer type -> its mask for this microbatch (no padding mask: pp_tp microbatches are whole sequences, so
        recurrent masks are None, as in the model's own forward without one)."""
        kwargs = {"config": config, "inputs_embeds": h, "attention_mask": None, "position_ids": position_ids}
        if self.family is not None:
            masks = self.family(**kwargs, cache=None)
            if not isinstance(masks, dict):
                return dict.fromkeys(self.types, masks)
            return {t: masks.get(t) for t in self.types}
        out: dict[str, Any] = {}
        for t, maker in self.makers.items():
            if isinstance(maker, dict) and self.separate:  # its attention part as attention_mask (see below)
                fn = maker[FULL]
                out[t] = fn(**kwargs, **mask_without_cache(fn))
            elif isinstance(maker, dict):  # a hybrid layer: one mask per part of it
                out[t] = {part: fn(**kwargs, **mask_without_cache(fn)) for part, fn in maker.items()}
            else:
                out[t] = maker(**kwargs, **mask_without_cache(maker))
        return out


def _separate_mixer_mask(model: nn.Module) -> bool:
    """Whether the family's hybrid layers take their mixer's mask as an argument of its own beside attention_mask
    (Falcon-H1's `mamba_attention_mask`): they then get the attention part as attention_mask and leave the other at
    its default, None, which is what the recurrent mask is without padding (pp_tp microbatches have none)."""
    for module in model.modules():
        params = inspect.signature(module.forward).parameters
        if "attention_mask" in params and any(p.endswith("_attention_mask") and p != _CROSS for p in params):
            return True
    return False


def _shards(fqn: str, resolved: dict[str, str]) -> bool:
    """Whether a rule of `resolved` (a block's FQN -> style) splits the module at `fqn` or a module holding it."""
    for rule_fqn, style in resolved.items():
        record = TP_STYLES[style]
        if (fqn == rule_fqn or fqn.startswith(rule_fqn + ".")) and (
            record.sharded_dim is not None or record.head_params or record.parts > 1 or record.splits_mixer
        ):
            return True
    return False


def whole_on_tp(parts: Iterable[nn.Module]) -> dict[str, tuple[tuple[str, ...], int]]:
    """`whole_in_blocks` over these stages' (StageModules') blocks: what this rank holds and runs whole."""
    found: dict[str, tuple[tuple[str, ...], int]] = {}
    for part in parts:
        for name, (classes, count) in whole_in_blocks(part.block_modules(), part.layout).items():
            seen, before = found.get(name, ((), 0))
            found[name] = (tuple(sorted({*seen, *classes})), before + count)
    return dict(sorted(found.items()))


def whole_in_blocks(blocks: Iterable[nn.Module], layout: ModelLayout) -> dict[str, tuple[tuple[str, ...], int]]:
    """{block-relative module: (its classes, parameter count summed over `blocks`)} for the largest modules whose
    Linear layers the TP plan splits none of: every TP rank holds and runs them whole (a mixer split by no head, an
    MLP the family's plan leaves out, MLA's latent projections)."""
    found: dict[str, tuple[set[str], int]] = {}
    for block in blocks:
        resolved = verify(block, block_plan(block, layout)).resolved
        linears = [n for n, m in block.named_modules() if isinstance(m, nn.Linear)]
        whole = {n for n in linears if not _shards(n, resolved)}
        for top in {_largest(n, linears, whole) for n in whole}:
            module = block.get_submodule(top)
            classes, count = found.get(top, (set(), 0))
            found[top] = (classes | {type(module).__name__}, count + sum(p.numel() for p in module.parameters()))
    return {k: (tuple(sorted(c)), n) for k, (c, n) in sorted(found.items())}


def _largest(name: str, linears: list[str], whole: set[str]) -> str:
    """The highest module holding `name` below the block whose Linear layers are all in `whole`."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        holder = ".".join(parts[:i])
        if all(n in whole for n in linears if n.startswith(holder + ".")):
            return holder
    return name
