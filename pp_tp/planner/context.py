"""What context parallel (`parallel.cp`) adds to a plan beyond what the fake forward measures.

The stage forward itself runs under cp on fake tensors (pp_tp.planner.activations): seq / cp local tokens, the K/V
all-gather of every attention layer on the fake process group, so the gathered keys and values attention saves are
measured like any activation (causal layers run fused blocks and save no mask; a masked layer's shared float mask
is measured once per microbatch). Two things cannot be measured there:

- the boolean masks each stage's `ContextParallel` keeps cached across steps for masked layers (sliding windows;
  read off the stage after its fake forward, `held_mask_bytes`): kept like the receive buffers, not freed by the
  backward; none for causal layers;
- the bytes the all-gathers move: the fake group moves nothing, so they are analytic (`kv_gather_bytes`), checked
  against a run's collective ledger in tests/test_context_parallel.py.
"""

from __future__ import annotations

from torch import nn

from pp_tp.config import ParallelConfig
from pp_tp.layout import ModelDims
from pp_tp.parallel.context_parallel import ContextParallel as CP


def held_mask_bytes(stage: nn.Module) -> int:
    """Bytes of the attention masks the stage's cp groups cache, after a forward (0 without context parallel)."""
    groups = {id(cp): cp for m in stage.modules() if isinstance(cp := getattr(m, "context_parallel", None), CP)}
    return sum(cp.held_bytes() for cp in groups.values())


def kv_gather_bytes(microbatch: int, seq: int, dims: ModelDims, pcfg: ParallelConfig) -> int:
    """One attention layer's K and V gathered over cp for one microbatch of `seq`-token sequences: two tensors of
    [microbatch, n_kv_heads / tp, seq, head_dim] in the activation dtype (the payload of its two all-gathers in the
    collective ledger; the backward's reduce-scatter of their gradients, an all-reduce on gloo, moves as many)."""
    act = 2 if pcfg.mixed_precision == "bf16" else 4
    head_dim = dims.head_dim or dims.dim // dims.n_heads
    return 2 * microbatch * seq * (dims.n_kv_heads // pcfg.tp) * head_dim * act


def rank_kv_bytes(layers: int, pcfg: ParallelConfig, microbatch: int, seq: int, dims: ModelDims) -> float:
    """Bytes one rank sends to its cp peers per step: for each of its `layers` attention layers and each
    microbatch, (cp - 1) / cp of kv_gather_bytes forward (all-gather) and as many backward (reduce-scatter)."""
    if pcfg.cp == 1:
        return 0.0
    return 2 * layers * pcfg.microbatches * kv_gather_bytes(microbatch, seq, dims, pcfg) * (pcfg.cp - 1) / pcfg.cp
