"""float64 throughout: the casts to fp32 a model's own code makes inside a float64 model, made float64 instead.

Some transformers families compute parts in fp32 whatever the model's dtype (measured with a dispatch mode over the
float64 forward + backward: Gemma 3's and DeepSeek-V3.2's RMSNorm `x.float()` / `.to(torch.float32)`, Gemma 3's
rotary table, V3.2's indexer scores, Nemotron-H's norms, Mamba2 scan, router and `lm_head(...).float()` logits,
Qwen3.5's decay gate and chunked delta rule). Two float64 builds of such a model then agree only to fp32 roundoff
wherever their float64 inputs to those casts differ by float64 roundoff (a different summation order: microbatches,
TP and DP reductions), so a 1e-10 bound could not tell the layout from fp32 noise. Under `Float64Throughout` every
op asked for an fp32 result (a cast, a factory, a reduction's dtype) returns float64 instead: the same math, all in
float64, so the pipelined build and the plain model must agree to float64 roundoff. Home-made: torch has no switch
that overrides a model's explicit dtype requests; a dispatch mode is torch's own hook for rewriting ops.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from pp_tp.base._torch import TorchDispatchMode


class Float64Throughout(TorchDispatchMode):
    """While active (on every rank, around both builds' steps), an op's `dtype=torch.float32` is float64; `widened`
    counts the ops it changed, by name (how much of a model's own code asked for fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.widened: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if kwargs.get("dtype") == torch.float32:
            kwargs = {**kwargs, "dtype": torch.float64}
            self.widened[str(func.overloadpacket)] += 1
        return func(*args, **kwargs)
