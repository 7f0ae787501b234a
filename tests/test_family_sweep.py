"""A fixed subset of bench/family_sweep.py in CI: each family's verdict through pp_tp on default options.

The sweep builds each family's default config shrunk by pp_tp's `small_config` with seeded random weights (all-zero
router biases stirred) and judges one `Pipeline.step` on 4 ranks (pp2 x tp2; MoE pp2 x dp_shard2 x ep2) by
pp_tp.parity's verdict: the loss and every full gradient against a float64 run of the plain model, the plain fp32 run
the yardstick; persistent buffers equal, every parameter covered. Checked here: dense families (a tied one on the
default embedding, two with a dropout module in their pipeline plan, Apertus whose MLP holds xIELU's learnable scalars
and runs whole on every TP rank) and MoE families with a persistent router bias or experts found by structure
(JetMoE's, split over 2 EP ranks) come out exact, and a family pp_tp cannot run (a layer fed by the previous layer's
output) is refused in the same line on every rank, for that reason.
No family may be wrong; and a run that is (a gradient doubled, a DP sum left out) is classified wrong, not exact.
"""

from __future__ import annotations

import copy
import os
import sys
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import family_sweep  # noqa: E402  (bench/family_sweep.py)

from pp_tp.parity import mean_token_loss  # noqa: E402

EXACT = ["llama", "phi3", "deepseek_v2", "glm4_moe", "dots1", "gemma2", "gpt_neox", "phi", "apertus", "jetmoe"]
# model type -> what the refusal names
REFUSED = {"hy_v4": "previous layer's 'topk_indices'"}


def test_family_verdicts(world):
    rows = {r.model_type: r for r in family_sweep.sweep(EXACT + list(REFUSED), world(family_sweep.WORLD))}
    assert [r for r in rows.values() if r.verdict == "wrong"] == []
    for name in EXACT:
        assert rows[name].verdict == "exact", rows[name]
        assert rows[name].loss_score <= 1.0 and rows[name].grad_score <= 1.0, rows[name]
    for name, reason in REFUSED.items():
        assert rows[name].verdict == "refused" and reason in rows[name].note, rows[name]


def _pipelined(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, plant: str) -> tuple[float, SimpleNamespace]:
    """A stand-in for one rank's Pipeline.step: the fp32 model on two microbatches of half the rows (the gradients
    summed in another order than the plain run's), with `plant` an error: 'double' doubles the head's gradient,
    'no_sum' keeps the first microbatch's gradients alone (a gradient all-reduce left out; the loss still right)."""
    part = copy.deepcopy(model)
    loss = 0.0
    for i, (x, y) in enumerate(zip(ids.chunk(2), labels.chunk(2))):
        half = mean_token_loss(part, x, y) / 2
        if plant != "no_sum" or not i:
            half.backward()
        loss += half.item()
    if plant == "double":
        part[2].weight.grad *= 2
    part.checkpoint_keys = {k: k for k, _ in part.named_parameters()}
    return loss, SimpleNamespace(model_parts=[part])


def _verdicts() -> dict[str, family_sweep.Row]:
    """Each planted error's row, from the sweep's own references, `judged_step` and `classify`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Tanh(), nn.Linear(16, 32))
    ids, labels = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    plain, truth = family_sweep.references(model)
    for run in (plain, truth):
        family_sweep.step_reference(run, ids, labels)
    context = {"family": "Toy", "layout": "pp2 tp2", "attn": "sdpa", "dropout": [], "noise": [], "mixers": ""}
    rows = {}
    for plant in ("none", "double", "no_sum"):
        loss, pipe = _pipelined(model, ids, labels, plant)
        answer = {**context, **family_sweep.judged_step(pipe, loss, plain, truth), "params": sorted(plain.params())}
        rows[plant] = family_sweep.classify("toy", [answer] * family_sweep.WORLD)
    return rows


def test_a_wrong_gradient_is_wrong_against_the_float64_truth():
    """The sweep's verdict in one process (no world): pipelined gradients that only sum in another order are exact;
    a gradient doubled or an all-reduce left out is wrong, named, whatever fp32's roundoff on this machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tensors this small: a thread pool on a busy CPU costs 10x the work (1.3 s vs 0.1 s)
    try:
        rows = _verdicts()
    finally:
        torch.set_num_threads(threads)
    assert rows["none"].verdict == "exact" and rows["none"].grad_score <= 1.0, rows["none"]
    assert rows["none"].loss_score <= 1.0, rows["none"]
    for plant, worst in (("double", "2.weight"), ("no_sum", "")):
        row = rows[plant]
        assert row.verdict == "wrong" and row.loss_score <= 1.0 and row.grad_score > 1e5, row
        assert row.note.startswith(f"worst grad {worst}"), row


def test_a_repaired_default_config_says_so():
    """DBRX's default attn_config lacks rope_theta and clip_qkv, which its own model reads ("no attribute
    'rope_theta'", then "torch.clamp: At least one of 'min' or 'max' must not be None"): the sweep's config carries
    dbrx-instruct's values (the sweep shows the model then builds and runs), and the row's note names the repair."""
    attn = family_sweep.default_config("dbrx").attn_config
    assert (attn.rope_theta, attn.clip_qkv, attn.kv_n_heads) == (500000.0, 8, 1)  # the rest stays default
    note = family_sweep.repair_note("dbrx")
    assert note == "config repaired: attn_config.rope_theta=500000.0, attn_config.clip_qkv=8"
    assert family_sweep.repair_note("llama") == ""
