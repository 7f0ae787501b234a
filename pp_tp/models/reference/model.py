"""The reference Llama-style decoder: RoPE, RMSNorm, GQA attention via SDPA, SwiGLU MLP (or experts, moe.py).

Layers live in an ``nn.ModuleDict`` keyed by the global layer index, so a parameter keeps its name
(``layers.7.attention.wq.weight``) whichever pipeline stage ends up holding it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pp_tp.base.seeded_init import default_init_std, init_weights
from pp_tp.base.tensors import at_least_fp32
from pp_tp.config.schema import ModelShape
from pp_tp.config.sections import check_moe
from pp_tp.models.reference.moe import MoE, init_expert_bias


@dataclass
class ModelArgs(ModelShape):
    """The reference Transformer's arguments: exactly the `[model]` shape keys, defined once in the config."""


def rope_cache(head_dim: int, max_seq_len: int, theta: float, device=None) -> torch.Tensor:
    """Returns [max_seq_len, head_dim // 2, 2] (cos, sin) in fp32; real-valued so DTensor/compile are happy."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    return torch.stack([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: [b, s, h, d]; rotates adjacent pairs of channels. `rope`: the table (positions 0..s-1) or the rows of
    per-token positions, [b, s, d/2, 2] (`rope[position_ids]`)."""
    if rope.dim() == 3:
        cos, sin = (rope[None, : x.shape[1], None, :, i] for i in (0, 1))  # [1, s, 1, d/2]
    else:
        cos, sin = (rope[:, :, None, :, i] for i in (0, 1))  # [b, s, 1, d/2]
    xf = at_least_fp32(x).unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] boolean attention mask: causal, and inside the document of each query (a document starts
    wherever the position does not follow the previous one, as transformers reads packed position ids)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    doc = starts.cumsum(-1)
    causal = torch.ones(doc.shape[1], doc.shape[1], dtype=torch.bool, device=doc.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = at_least_fp32(x)
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * at_least_fp32(self.weight)).type_as(x)


class Attention(nn.Module):
    # Set by context parallel (pp_tp.parallel.context_parallel): the rank's queries attend to the keys and values
    # of the whole sequence, gathered over the cp ranks: causal by blocks with no mask, or under a given mask.
    context_parallel = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        hd = args.head_dim
        self.head_dim = hd
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=args.attn_bias)
        self.wk = nn.Linear(args.dim, args.kv_heads * hd, bias=args.attn_bias)
        self.wv = nn.Linear(args.dim, args.kv_heads * hd, bias=args.attn_bias)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=args.attn_bias)
        self.q_norm = RMSNorm(hd, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(hd, args.norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # Head counts come from the (possibly tensor-parallel) projection widths, so a TP shard
        # runs with its local heads without any attribute rewriting.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        cp = self.context_parallel
        if cp is not None and mask is None and cp.fused(q, k):  # causal over the gathered keys, no mask built
            out = cp.causal_attention(q, k, v)
        else:
            if cp is not None:  # a given mask (packed documents) covers the gathered keys (layout.py)
                k, v = cp.gather(k, 2), cp.gather(v, 2)
                mask = cp.mask(s, x.device) if mask is None else mask  # no fused kernel for these tensors
                mask = cp.additive(mask, q.dtype, float("-inf"), None)  # one float mask for all layers this step
            gqa = q.shape[1] != k.shape[1]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.is_moe_layer(layer):
            n_shared = args.n_shared_experts * args.expert_dim
            self.feed_forward = MoE(args, FeedForward(args.dim, n_shared) if n_shared else None)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        check_moe(args)
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: recomputed by init_rope() after meta-device construction.
        self.register_buffer("rope", rope_cache(args.head_dim, args.max_seq_len, args.rope_theta), persistent=False)

    def init_rope(self) -> None:
        self.rope = rope_cache(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, self.rope.device)

    def init_weights(self, seed: int = 0) -> None:
        """Values depend only on (seed, parameter FQN): pp_tp.base.seeded_init with this model's std rule; router
        biases zero."""
        self.init_rope()
        init_expert_bias(self)
        init_weights(self, seed, self.args.n_layers, param_init_std)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits; with `position_ids` (restarting at each packed document) attention stays inside documents."""
        h = self.tok_embeddings(input_ids)
        extras = (self.rope,) if position_ids is None else (self.rope[position_ids], document_mask(position_ids))
        for layer in self.layers.values():
            h = layer(h, *extras)
        return self.output(self.norm(h))


def param_init_std(fqn: str, n_layers: int) -> float | None:
    """The reference model's init rule: the default, with output projections (experts' down_proj too) scaled by
    1/sqrt(2 n_layers)."""
    if fqn.endswith(("wo.weight", "w2.weight", "experts.down_proj")):
        return 0.02 / math.sqrt(2 * n_layers)
    return default_init_std(fqn, n_layers)
