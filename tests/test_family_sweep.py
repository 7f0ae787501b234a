"""A fixed subset of bench/family_sweep.py in CI: each family's verdict through pp_tp on default options.

The sweep builds each family's default config shrunk by pp_tp's `small_config` with seeded random weights (all-zero
router biases stirred) and compares one `Pipeline.step` on 4 ranks (pp2 x tp2; MoE pp2 x dp_shard2) with the
model's own forward + backward: loss, every full gradient, persistent buffers and parameter coverage. Checked here:
dense families (a tied one on the default embedding, two with a dropout module in their pipeline plan) and MoE
families with a persistent router bias come out exact, and families pp_tp cannot run (a layer fed by the previous
layer's output, an activation parameter no TP rule covers) are refused in the same line on every rank, for that
reason. No family may be wrong.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import family_sweep  # noqa: E402  (bench/family_sweep.py)

EXACT = ["llama", "phi3", "deepseek_v2", "glm4_moe", "dots1", "gemma2", "gpt_neox", "phi"]
# model type -> what the refusal names
REFUSED = {
    "hy_v4": "previous layer's 'topk_indices'",
    "apertus": "alpha_p",
}


def test_family_verdicts(world):
    rows = {r.model_type: r for r in family_sweep.sweep(EXACT + list(REFUSED), world(family_sweep.WORLD))}
    assert [r for r in rows.values() if r.verdict == "wrong"] == []
    for name in EXACT:
        assert rows[name].verdict == "exact", rows[name]
    for name, reason in REFUSED.items():
        assert rows[name].verdict == "refused" and reason in rows[name].note, rows[name]
