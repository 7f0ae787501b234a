"""Hugging Face attention under context parallel: transformers' own attention function on the whole sequence.

A transformers attention module computes its queries, keys and values (rotary at the positions it is given) and
then calls `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)`. Under
context parallel each attention module of a stage gets a config copy naming `CP_ATTENTION`, registered with
transformers' AttentionInterface. A plain causal SDPA layer (full attention, no packed documents) runs
`ContextParallel.causal_attention`: fused blocks over K/V gathered in sequence order, merged by log-sum-exp, no mask.
Every other layer all-gathers K and V over cp and calls the function the model chose ("sdpa", or the family's own
eager one: sinks, softcapping) on the local queries against every key, with the boolean causal or sliding-window
mask of this layer's type at the rank's head-tail positions, inside packed documents where the step has them (the
mask transformers built for the local tokens alone is not used). Other kernels (flash, flex) are refused in one
line.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.parallel.context_parallel import ContextParallel, register_cp_attention

CP_ATTENTION = "pp_tp_context_parallel"
KERNELS = ("sdpa", "eager")


def _window(module: nn.Module) -> int | None:
    """The layer's sliding window, read as pp_tp's HF layout reads the layer's type (config.layer_types, else
    config.sliding_window for every layer); None for full attention."""
    config = module.config
    types = getattr(config, "layer_types", None)
    kind = types[module.layer_idx] if types is not None else None
    if kind not in (None, "full_attention", "sliding_attention"):  # chunked: its mask is not a window
        raise ConfigError(
            f"parallel.cp > 1: layer {module.layer_idx} of {type(module).__name__} runs {kind!r}, which pp_tp's "
            "context parallel does not mask; set parallel.cp = 1"
        )
    sliding = kind == "sliding_attention" if types is not None else None
    window = getattr(config, "sliding_window", None)
    return window if (sliding if sliding is not None else window is not None) else None


def _inner(module: nn.Module) -> Callable[..., Any]:
    """The attention function the model itself would call."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(module.cp_kernel, eager)


def _blockwise(
    module: nn.Module, window: int | None, cp: ContextParallel, query: torch.Tensor, key: torch.Tensor, kwargs: dict
) -> bool:
    """Whether the layer is plain causal SDPA, which `ContextParallel.causal_attention` runs exactly with no mask:
    the "sdpa" kernel (eager functions add softcapping, sinks), no window, no packed documents, no dropout, position
    bias, softcap or sinks argument, causal, on a fused kernel for these tensors. Everything else keeps the
    boolean-mask path."""
    plain = module.cp_kernel == "sdpa" and window is None and not cp.documents and not kwargs.get("dropout")
    plain = plain and all(kwargs.get(k) is None for k in ("position_bias", "softcap", "s_aux"))
    plain = plain and kwargs.get("is_causal", getattr(module, "is_causal", True))
    return bool(plain) and cp.fused(query, key)


def cp_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """Local queries [B, H, S/cp, D] against the keys and values of every cp rank, under this layer's mask."""
    cp: ContextParallel = module.context_parallel
    window = _window(module)
    if _blockwise(module, window, cp, query, key, kwargs):
        out = cp.causal_attention(query, key, value, kwargs.get("scaling"))
        return out.transpose(1, 2).contiguous(), None  # [B, S/cp, H, D], as transformers' sdpa_attention_forward
    key, value = cp.gather(key, 2), cp.gather(value, 2)
    allowed = cp.attention_mask(query.shape[2], query.device, window, kwargs.get("position_ids"))
    # eager functions add the mask to the scores (transformers fills with the dtype's min); SDPA would turn a boolean
    # mask into -inf itself in every layer: one float mask per step and window, shared by the layers
    fill = torch.finfo(query.dtype).min if module.cp_kernel == "eager" else float("-inf")
    mask = cp.additive(allowed, query.dtype, fill, window)
    return _inner(module)(module, query, key, value, mask, **kwargs)


def install(attention: nn.Module, cp: ContextParallel) -> bool:
    """Points a transformers attention module at `cp_attention` (its own config copy; the model's other modules and
    its mask functions keep the original); False for a module that is not one."""
    config = getattr(attention, "config", None)
    if config is None or not hasattr(attention, "layer_idx") or not hasattr(config, "_attn_implementation"):
        return False
    kernel = getattr(attention, "cp_kernel", None) or config._attn_implementation or "sdpa"
    eager = getattr(sys.modules[type(attention).__module__], "eager_attention_forward", None)
    if kernel not in KERNELS or (kernel == "eager" and eager is None):
        raise ConfigError(
            f"parallel.cp > 1: {type(attention).__name__} runs the {kernel!r} attention kernel, which pp_tp cannot "
            'run over gathered keys; use attn_implementation = "sdpa" or "eager", or set parallel.cp = 1'
        )
    _window(attention)  # refuses a layer type cp cannot mask, here in the build rather than in a forward
    if config._attn_implementation != CP_ATTENTION:
        config = copy.deepcopy(config)
        config._attn_implementation = CP_ATTENTION
    attention.config, attention.cp_kernel, attention.context_parallel = config, kernel, cp
    return True


def _installing(attention: nn.Module, cp: ContextParallel) -> bool:
    """`install`, after registering `cp_attention` with transformers (imported only where a model came from it)."""
    if "transformers" not in sys.modules:
        return False
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, cp_attention)
    return install(attention, cp)


register_cp_attention(_installing)
