"""The reference Transformer: shapes, causal masking, GQA, init that depends only on (seed, FQN)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from pp_tp.models.reference.model import ModelArgs, Transformer, apply_rope

ARGS = ModelArgs(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=32, qk_norm=True, attn_bias=True
)


def _model(args: ModelArgs = ARGS, seed: int = 0) -> Transformer:
    m = Transformer(args)
    m.init_weights(seed)
    return m


def test_logits_shape_and_layer_names():
    m = _model()
    out = m(torch.randint(0, 64, (3, 10)))
    assert out.shape == (3, 10, 64)
    assert "layers.1.attention.q_norm.weight" in dict(m.named_parameters())


def test_causal_masking_future_tokens_do_not_leak():
    m = _model()
    ids = torch.randint(0, 64, (1, 12))
    changed = ids.clone()
    changed[0, 7:] = (changed[0, 7:] + 1) % 64
    a, b = m(ids), m(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-4


def test_gqa_equals_attention_with_repeated_kv_heads():
    m = _model(replace(ARGS, qk_norm=False, attn_bias=False))
    attn = m.layers["0"].attention
    x = torch.randn(2, 9, 32)
    rope = m.rope
    q = apply_rope(attn.wq(x).view(2, 9, 4, 8), rope).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(2, 9, 2, 8), rope).transpose(1, 2).repeat_interleave(2, dim=1)
    v = attn.wv(x).view(2, 9, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
    ref = attn.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 9, 32))
    torch.testing.assert_close(attn(x, rope), ref)


def test_init_depends_only_on_seed_and_name():
    a, b = _model(seed=3), _model(replace(ARGS, n_layers=4), seed=3)
    pb = dict(b.named_parameters())
    for name, p in a.named_parameters():
        if name.endswith(("wo.weight", "w2.weight")):  # std scales with depth: same draw, other scale
            torch.testing.assert_close(p * (2**0.5), pb[name] * 2, rtol=1e-6, atol=0)
        else:
            torch.testing.assert_close(p, pb[name], rtol=0, atol=0)
    c = _model(seed=4)
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)


def test_meta_construction_then_init_matches_direct_init():
    with torch.device("meta"):
        m = Transformer(ARGS)
    m.to_empty(device="cpu")
    m.init_weights(0)
    ref = _model(seed=0)
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    ids = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(m(ids), ref(ids))


def test_tied_embeddings_share_one_parameter():
    m = _model(replace(ARGS, tie_embeddings=True))
    assert m.output.weight is m.tok_embeddings.weight
    assert "output.weight" not in dict(m.named_parameters())
