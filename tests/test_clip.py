"""Gradient clipping over a pipeline's local shards: the clipped norm (2 and inf) is the whole model's, and every
full gradient is the reference's scaled, with FSDP shards, TP shards beside plain norms, and a tied weight.
"""

from __future__ import annotations

from dataclasses import replace

import parity_utils as pu
import pytest
import torch

from pp_tp.parallel.grads import clip_grad_norm_, total_grad_norm

# Below the TINY model's gradient norm (about 1.1-1.4 here), so clipping really scales.
MAX_NORM = 0.1


CLIP_CASES = [  # FSDP shards; TP shards beside plain norms (no FSDP); a tied weight on both pp ranks, vocab-parallel
    (dict(pp=2, dp_shard=2, schedule="Interleaved1F1B", stages_per_rank=2, microbatches=2), pu.TINY),
    (dict(pp=2, tp=2, schedule="1F1B", microbatches=2), pu.TINY),
    (
        dict(pp=2, tp=2, schedule="1F1B", microbatches=2, embedding="vocab_parallel"),
        replace(pu.TINY, tie_embeddings=True),
    ),
]


def clip_case() -> list[dict]:
    """After clipping, the whole model's norm is max_norm and every full gradient is the reference's, scaled."""
    out = []
    for kw, args in CLIP_CASES:
        state = pu.reference_state(args)
        ids, labels = pu.batch(args, 8, 16)
        ref = pu.reference_run(state, ids, labels, args)
        got = pu.run_pipeline(pu.pcfg_of(**kw), state, ids, labels, args)  # one step: params moved, not grads
        parts, mesh = got["pipe"].model_parts, got["pipe"].mesh
        ref_norm = torch.nn.utils.get_total_norm(list(ref["grads"].values())).item()
        norm = clip_grad_norm_(parts, MAX_NORM, mesh).item()
        after = total_grad_norm(parts, mesh).item()
        scale = MAX_NORM / (ref_norm + 1e-6)
        err = max(
            pu.rel_err(pu.full_tensor(p.grad), ref["grads"][part.checkpoint_keys[k]] * scale)
            for part in parts
            for k, p in part.named_parameters()
        )
        inf = total_grad_norm(parts, mesh, norm_type=float("inf")).item()
        ref_inf = max(g.abs().max().item() for g in ref["grads"].values()) * scale
        out.append(dict(norm=norm, ref_norm=ref_norm, after=after, grad_err=err, inf=inf, ref_inf=ref_inf))
    return out


def test_clip_grad_norm_scales_every_shard(world):
    for per_rank in world(4).run(clip_case):
        for r in per_rank:
            assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5) and r["ref_norm"] > MAX_NORM
            assert r["after"] == pytest.approx(MAX_NORM, rel=1e-4)
            assert r["grad_err"] < 1e-5
            assert r["inf"] == pytest.approx(r["ref_inf"], rel=1e-5)
