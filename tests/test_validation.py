"""Validation under PP: the forward-only loss through every schedule equals the plain model's mean loss on
the same held-out batch, creates no gradient, and leaves training exactly as it would be without it."""

from __future__ import annotations

import copy

import parity_utils as pu
import pytest
import torch
from one_trip import run_cases

import pp_tp
from pp_tp.parity import dp_share, mean_token_loss

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def eval_case(kw: dict) -> dict:
    """Per schedule: validation loss vs the plain model, grads after it, and one train step with or without."""
    state = pu.reference_state()
    ids, labels = pu.batch(pu.TINY, 8, 16, seed=3)
    model = pu.make_model()
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        want = mean_token_loss(model, ids, labels).item()
    out = {}
    for name in SCHEDULES:  # stages_per_rank from the schedule (1, or 2 for multi-stage ones)
        pcfg = pu.pcfg_of(**kw, schedule=name, microbatches=4)
        pipe = pp_tp.build_pipeline(pu.make_model(device="meta"), pp_tp.build_mesh(pcfg), pcfg, state_dict=state)
        mine = (dp_share(pipe.mesh, ids), dp_share(pipe.mesh, labels))
        val = float(pipe.evaluate(*mine))
        no_grads = all(p.grad is None for part in pipe.model_parts for p in part.parameters())
        train_loss = float(pipe.step(*mine))  # eval -> train switch
        val_again = float(pipe.evaluate(*mine))  # train -> eval switch, grads now exist and must not change
        out[name] = {"err": abs(val - want) / want, "no_grads": no_grads, "train": train_loss, "again": val_again}
    return out


@pytest.fixture(scope="module")
def two_ranks(world) -> dict[str, list]:
    """Every 2-rank case of this file in one round trip (tests/one_trip.py)."""
    cases = [("eval pp2", eval_case, (dict(pp=2),))]
    cases += [(f"train with_eval={flag}", train_with_eval_case, (flag,)) for flag in (True, False)]
    return run_cases(world(2), cases)


def test_validation_loss_is_exact_on_every_schedule_and_touches_no_gradient(world, two_ranks):
    for kw in (dict(pp=2), dict(pp=2, dp_shard=2)):
        results = two_ranks["eval pp2"] if kw.get("dp_shard", 1) == 1 else world(4).run(eval_case, kw)
        for res in results:
            for name, r in res.items():
                assert r["err"] <= 1e-5 and r["no_grads"], (kw, name, r)
                assert abs(r["train"] - r["again"]) <= 1e-5 * r["train"], (kw, name, r)  # same weights, same loss


def train_with_eval_case(with_eval: bool) -> list[float]:
    state = pu.reference_state()
    ids, labels = pu.batch(pu.TINY, 8, 16)
    pcfg = pu.pcfg_of(pp=2, microbatches=4)
    pipe = pp_tp.build_pipeline(
        pu.make_model(device="meta"), pp_tp.build_mesh(pcfg), pcfg, state_dict=copy.deepcopy(state)
    )
    opt = torch.optim.AdamW([p for part in pipe.model_parts for p in part.parameters()], lr=1e-2)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        losses.append(float(pipe.step(ids, labels)))
        if with_eval:
            pipe.evaluate(ids, labels)
        opt.step()
    return losses


def test_validation_between_backward_and_optimizer_step_changes_nothing(two_ranks):
    assert two_ranks["train with_eval=True"] == two_ranks["train with_eval=False"]
