"""Analytic per-token cost (forward + backward FLOPs) of embedding, blocks and head, for balancing stages.

FLOPs, not parameters, set a stage's time: a block costs 6 x its matmul parameters plus causal attention
(6 * seq * dim), the head 6 * dim * vocab plus the cross-entropy, the embedding a gather (nearly free).
Parameters are reported beside the cost because they set a stage's memory.
"""

from __future__ import annotations

from pp_tp.layout import ModelDims


def block_params(d: ModelDims) -> int:
    head_dim = d.dim // d.n_heads
    attn = d.dim * head_dim * (2 * d.n_heads + 2 * d.n_kv_heads)
    return attn + 3 * d.dim * d.ffn_dim + 2 * d.dim


def block_flops(d: ModelDims, seq_len: int) -> float:
    matmul = block_params(d) - 2 * d.dim
    return 6.0 * matmul + 6.0 * seq_len * d.dim


def head_flops(d: ModelDims) -> float:
    # matmul fwd+bwd plus ~10 elementwise ops per logit for softmax cross-entropy and its gradient
    return 6.0 * d.dim * d.vocab_size + 10.0 * d.vocab_size


def embed_flops(d: ModelDims) -> float:
    # gather forward, scatter-add backward
    return 2.0 * d.dim
