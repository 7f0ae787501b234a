"""A Hugging Face block's mixer beyond softmax attention (linear attention, state-space, indexed attention): the
mask each layer type gets, and which modules tensor parallelism leaves whole on every TP rank.

Masks come from transformers' own table, `masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING` (what `generate`
builds per layer type): linear-attention and conv layers get the recurrent (padding) mask, indexed attention the
materialized causal mask, a hybrid layer a dict of its masks. A family that declares its own
`create_masks_for_generate` gives its layers what that returns where the table lacks one of its layer types
(Nemotron-H's MLP and MoE layers, which take no mask).
A layer type neither knows is refused in one line naming it. The self-check still proves every composition.

A mixer pp_tp cannot split by heads runs whole on every TP rank (pp_tp.parallel.whole_on_tp names them).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pp_tp.errors import ConfigError

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
