"""How pp_tp calls a model's own forward as a reference (the self-check, the parity runs, the sweep)."""

from __future__ import annotations

import inspect

from torch import nn


def without_cache(model: nn.Module) -> dict[str, bool]:
    """use_cache=False where the forward takes it: training keeps no KV cache (pp_tp's block context calls every
    layer without one), and some families' cache code fails on stacks without attention (Bamba's get_seq_length)."""
    return {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
