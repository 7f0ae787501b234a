"""The float64 verdict (pp_tp/parity/lockstep.py): a correct build passes on any machine, a badly conditioned
tensor is judged by how badly conditioned it is, planted bugs fail, and every shipped CPU config passes `pp-tp parity`
with its defaults."""

from __future__ import annotations

import copy
import glob
import os
from dataclasses import replace

import parity_utils as pu
import pytest
import torch
from one_trip import run_cases
from torch.distributed.tensor import DTensor, Replicate

import pp_tp
from pp_tp.base.tensors import full_tensor
from pp_tp.cli.parity import run_parity
from pp_tp.config import load_config
from pp_tp.parity import FACTOR, PipelineRun, floor_for, judge, lockstep
from pp_tp.runtime.loss import TokenSumLoss

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(glob.glob(os.path.join(REPO, "toml_configs", "*_cpu.toml")))
FLOOR = floor_for(torch.float32)


def test_judge_scales_with_the_plain_builds_distance():
    truth = {"w": torch.ones(100, dtype=torch.float64)}
    noisy = {"w": truth["w"] + 1e-4}  # a badly conditioned tensor: the plain fp32 build is 1e-4 off
    close = {"w": truth["w"] + 5e-4}
    assert judge(close, noisy, truth, {}, FLOOR).score <= 1.0  # 5x the plain's distance: roundoff, passes
    far = {"w": truth["w"] + 2 * FACTOR * 1e-4}
    assert judge(far, noisy, truth, {}, FLOOR).score > 1.0
    exact_plain = {"w": truth["w"].clone()}
    assert judge(close, exact_plain, truth, {}, FLOOR).score > 1.0  # where the plain is exact, the floor decides
    assert judge({"w": truth["w"] + 1e-7}, exact_plain, truth, {}, FLOOR).score <= 1.0
    r = judge({"w": torch.ones(3)}, noisy, truth, {}, FLOOR)  # shaped otherwise
    assert r.score == float("inf") and r.name == "w"
    ints = {"b": torch.tensor([1, 2])}
    assert judge({"b": torch.tensor([1, 3])}, ints, ints, {}, FLOOR).score == float("inf")


class DropFirstMicrobatch(TokenSumLoss):
    """Planted bug: the first microbatch of every step adds its loss but no gradient."""

    calls = 0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = super().__call__(logits, labels)
        type(self).calls += 1
        return loss.detach() + 0 * loss if type(self).calls % 2 == 1 else loss


def _bias_twice(pipe) -> int:
    """Planted bug: every row-parallel attention output adds its bias a second time. Returns the hooks placed."""
    hooks = 0
    for part in pipe.model_parts:
        for name, mod in part.named_modules():
            if name.endswith("attention.wo"):
                mod.register_forward_hook(lambda m, i, out: out + full_tensor(m.bias))
                hooks += 1
    return hooks


def _astray(pipe) -> str:
    """Planted bug: on tp rank 1 only, a replicated parameter's gradient is 1.5x after each backward (one replica off:
    its own rank must judge it). Returns the parameter's name."""
    name, param = next(
        (n, p)
        for part in pipe.model_parts
        for n, p in part.named_parameters()
        if not isinstance(p, DTensor) or p.placements == (Replicate(),)
    )
    step = pipe.step

    def astray(*batch):
        loss = step(*batch)
        if pipe.mesh.get_local_rank("tp") == 1:
            (param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad).mul_(1.5)
        return loss

    pipe.step = astray
    return name


def planted_case() -> dict:
    """pp2 x tp2, the reference model with biases: the correct build over two steps (its references stepped on one
    rank and mirrored, then on every rank), then each planted bug over one; the worst score each."""
    args = replace(pu.TINY, attn_bias=True)
    pcfg = pu.pcfg_of(pp=2, tp=2, schedule="1F1B", microbatches=2)
    state = pu.reference_state(args)
    ids, labels = pu.batch(args, 8, 16)
    out = {}
    for bug in ("none", "unshared", "dropped_microbatch", "bias_twice", "astray"):
        run = pu.pipeline(pcfg, copy.deepcopy(state), args)
        if bug == "dropped_microbatch":
            run.pipe._loss.__class__ = DropFirstMicrobatch
        if bug == "bias_twice":
            out["hooks"] = _bias_twice(run.pipe)
        if bug == "astray":
            out["astray_param"], out["tp_rank"] = _astray(run.pipe), run.pipe.mesh.get_local_rank("tp")
        ref = pu.reference(state, args)
        steps = 2 if bug in ("none", "unshared") else 1  # a planted bug is off by far more from the first step
        batches = [(ids, labels)] * steps
        diffs = list(lockstep(PipelineRun(run.pipe, pu.adamw()), ref, batches, shared=bug != "unshared"))
        out[bug] = {**pu.summary(diffs), "ref_grads": ref.grads(), "ref_params": ref.params()}
    return out


@pytest.fixture(scope="module")
def four_ranks(world) -> dict[str, list]:
    """Every multi-rank case of this file in one round trip (tests/one_trip.py); the failing reference last."""
    return run_cases(world(4), [(fn.__name__, fn, ()) for fn in (planted_case, shipped_case, failing_reference_case)])


def test_planted_bugs_fail_and_the_correct_build_passes(four_ranks):
    for r in four_ranks["planted_case"]:
        pu.assert_passes(r["none"])
        assert r["dropped_microbatch"]["scores"]["grads"] > 100, r["dropped_microbatch"]
        assert r["hooks"] == 2 and r["bias_twice"]["scores"]["loss"] > 100, r["bias_twice"]
        # a replica off on its own rank fails there, and only there (the others' copies are right)
        astray = r["astray"]["scores"]["grads"]
        assert astray > 100 if r["tp_rank"] == 1 else astray <= 1.0, (r["astray_param"], r["tp_rank"], r["astray"])
        # the references stepped on one rank and mirrored (pp_tp/parity/shared.py) judge as when every rank steps them
        shared, unshared = r["none"], r["unshared"]
        assert shared["scores"] == unshared["scores"], (shared["scores"], unshared["scores"])
        for kind in ("ref_grads", "ref_params"):
            assert all(torch.equal(t, unshared[kind][k]) for k, t in shared[kind].items()), kind


def shipped_case() -> list[int]:
    """`pp-tp parity`'s per-rank run on every shipped CPU config with its defaults (0: every step passed)."""
    cfgs = [load_config(path, []) for path in SHIPPED]
    return [run_parity(cfg, 2, mesh=pp_tp.build_mesh(cfg.parallel)) for cfg in cfgs]


def test_every_shipped_cpu_config_passes_parity_with_its_defaults(four_ranks):
    assert len(SHIPPED) >= 6, SHIPPED
    for codes in four_ranks["shipped_case"]:
        assert codes == [0] * len(SHIPPED), dict(zip(SHIPPED, codes))


def _failing_loss(model, ids, labels):
    raise ValueError("planted reference failure")


def failing_reference_case() -> str:
    """The fp32 reference fails on the rank that steps it: every rank must end with that error, none may wait."""
    pcfg = pu.pcfg_of(pp=2, tp=2, schedule="1F1B", microbatches=2)
    state = pu.reference_state(pu.TINY)
    run = pu.pipeline(pcfg, copy.deepcopy(state), pu.TINY)
    ref = pu.reference(state, pu.TINY)
    ref.loss_of = _failing_loss
    try:
        list(lockstep(PipelineRun(run.pipe, pu.adamw()), ref, [pu.batch(pu.TINY, 8, 16)]))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_reference_failing_on_its_rank_ends_every_rank(four_ranks):
    for message in four_ranks["failing_reference_case"]:
        assert "failed: ValueError: planted reference failure" in message, message
