"""A Hugging Face MoE's routers, for load balancing (pp_tp/runtime/balancing.py), declared in its experts record
(pp_tp.models.hf.experts).

Routers: the modules transformers records `router_logits` from (`_can_record_outputs`, output 0), declared only when
a probe proves their probabilities are softmax(logits): on a small copy of the config (the self-check's), fixed seed,
random weights, the router returns (logits [T, E], top_k_weights [T, k], top_k_index [T, k]) and its weights are
softmax(logits) at the chosen experts up to one positive factor per token (renormalized or scaled). Sigmoid routers
(DeepSeek-V3) fail it, so the auxiliary loss is refused for them.
"""

from __future__ import annotations

import torch
from torch import nn

from pp_tp.models.hf.record import record_of, seeded_values

_TOKENS = 16


def _router_class(model: nn.Module) -> type | None:
    """The class transformers records router logits from as output 0, or None."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None or getattr(recorder, "index", None) != 0:
        return None
    return getattr(recorder, "target_class", None)


@torch.no_grad()
def _softmax_probe(cls: type, config) -> bool:
    """Whether `cls(config)` routes by softmax(logits) as the module docstring says (deterministic; kept in the
    family's record)."""
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            router = cls(config).to(torch.float32)
            for p in router.parameters():
                p.normal_()
            seeded_values(router, 1, None, zero_buffers=True)
            out = router(torch.randn(_TOKENS, config.hidden_size))
    except Exception:  # noqa: BLE001 - a router the probe cannot run is one pp_tp cannot identify
        return False
    if not isinstance(out, tuple) or len(out) != 3:
        return False
    logits, weights, index = out
    if logits.dim() != 2 or weights.shape != index.shape or index.is_floating_point() or index.shape[0] != _TOKENS:
        return False
    ratio = weights.float() / logits.float().softmax(dim=-1).gather(1, index)
    return bool((ratio > 0).all() and torch.allclose(ratio, ratio[:, :1].expand_as(ratio), rtol=1e-5, atol=0))


def block_routers(model: nn.Module, blocks: list[nn.Module]) -> tuple[str, ...]:
    """Block-relative names of the routers whose probabilities are softmax(logits) (empty when not proven)."""
    cls = _router_class(model)
    if cls is None:
        return ()
    record = record_of(model)
    if not record.derived(("router", cls), lambda: _softmax_probe(cls, record.small)):
        return ()
    return tuple(sorted({n for b in blocks for n, m in b.named_modules() if type(m) is cls}))
