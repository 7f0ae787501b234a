"""How pp_tp calls a model's own forward as a reference (the self-check, the parity runs, the sweep)."""

from __future__ import annotations

import inspect

from torch import nn


def without_cache(model: nn.Module) -> dict[str, bool]:
    """use_cache=False where the forward takes it, by name or through `**kwargs` handed on to a base model that
    takes it (GraniteMoeHybrid's causal LM): training keeps no KV cache (pp_tp's block context calls every layer
    without one), and some families' cache code fails on stacks without attention (Bamba's get_seq_length)."""
    params = inspect.signature(model.forward).parameters
    base = getattr(model, "base_model", model)
    handed = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) and base is not model
    takes = "use_cache" in params or (handed and "use_cache" in inspect.signature(base.forward).parameters)
    return {"use_cache": False} if takes else {}
