"""Models that are not language models (issue "Beyond decoder LMs"): declared TP (`_tp_col` / `_tp_row` on Linear
and 1x1 Conv2d), boundaries of any shape, the caller's loss. A CREDIT-style regression model and a ViT-like
classifier, pipelined with TP or FSDP, against the plain model on the same weights and batch."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from parity_utils import adamw, assert_parity, pcfg_of, summary
from torch import nn
from train_utils import REPO

import pp_tp
from pp_tp.cli.job import check_job
from pp_tp.cli.parity import run_parity
from pp_tp.config import load_config
from pp_tp.config.schema import LOSS_NAMES
from pp_tp.diagnostics.comm_ledger import CommLedger
from pp_tp.errors import ConfigError
from pp_tp.models.credit import CREDIT, CreditArgs, CreditModel
from pp_tp.models.vit import ViT, ViTArgs
from pp_tp.parallel.tensor_parallel import check_tp_plan
from pp_tp.parity import PipelineRun, ReferenceRun, dp_share, lockstep
from pp_tp.planner import plan_job
from pp_tp.preflight import PreflightInputs, preflight
from pp_tp.runtime.loss import LOSSES, SumLoss
from pp_tp.train.trainer import train

CREDIT_ARGS = CreditArgs(channels=4, image_size=16, patch_size=4, dim=32, n_layers=2, n_heads=4, ffn_dim=64)
VIT_ARGS = ViTArgs(channels=3, image_size=16, patch_size=4, dim=32, n_layers=2, n_heads=4, ffn_dim=64, n_classes=10)


def focal_sum(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """A loss of the caller's own: squared token cross-entropy, summed (ignored targets contribute nothing)."""
    return (F.cross_entropy(out.float(), tgt, ignore_index=-100, reduction="none") ** 2).sum()


def _model(kind: str, device: str = "cpu") -> nn.Module:
    """The model of `kind`: credit, vit, or credit_ri (credit whose MLP takes its input as one Replicate DTensor)."""
    with torch.device(device):
        model = ViT(VIT_ARGS) if kind == "vit" else CreditModel(CREDIT_ARGS)
    for block in model.blocks if kind == "credit_ri" else ():
        block._tp_plan = {"mlp": "replicate_input"}
    return model


def _state(kind: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        k: torch.randn(v.shape, generator=gen) * (0.1 if k.endswith("bias") else 0.2) + ("norm" in k) * 1.0
        for k, v in _model(kind).named_parameters()
    }


def _batch(kind: str, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets; the ViT's class targets have -100 spread unevenly over microbatches and DP ranks."""
    gen = torch.Generator().manual_seed(1)
    if kind.startswith("credit"):
        x = torch.randn(n, 4, 16, 16, generator=gen)
        return x, torch.randn(n, 4, 16, 16, generator=gen)
    x = torch.randn(n, 3, 16, 16, generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen)
    y[[1, 2, 3, 6]] = -100  # microbatches of 2 at dp 2: 1, 2, 0, 1 kept targets
    return x, y


class TargetsOnLastStage(PipelineRun):
    """The pipelined run where only the ranks holding the last stage are given the targets."""

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        mesh = self.pipe.mesh
        loss = float(self.pipe.step(dp_share(mesh, x), dp_share(mesh, y) if self.pipe.has_last_stage else None))
        self.optimizer.step()
        self.losses.append(loss)
        return loss


def _compare(kind: str, loss, normalizer: str, **pkw) -> dict:
    pcfg = pcfg_of(**pkw)
    state, (x, y) = _state(kind), _batch(kind)
    model = _model(kind)
    model.load_state_dict(state)
    ref = ReferenceRun(model, adamw(), loss=SumLoss(loss, normalizer))
    pipe = pp_tp.build_pipeline(
        _model(kind, "meta"), pp_tp.build_mesh(pcfg), pcfg, state_dict=copy.deepcopy(state), loss_fn=loss,
        loss_normalizer=normalizer,
    )  # fmt: skip
    run = TargetsOnLastStage(pipe, adamw())
    diffs = list(lockstep(run, ref, [(x, y)] * 2))
    with CommLedger() as led:
        pipe.step(dp_share(pipe.mesh, x), dp_share(pipe.mesh, y))
    return {
        **summary(diffs),
        "losses": run.losses,
        "names": sorted(run.keys),
        "all_names": sorted(ref.grads()),
        "pp_rank": pipe.mesh.get_local_rank("pp"),
        "tp_all_reduces": led.counts(group=pipe.mesh.get_group("tp")).get("all_reduce", 0) if pcfg.tp > 1 else 0,
        "blocks": sum(len(p.spec.blocks) for p in pipe.model_parts),
    }


CASES = [
    ("credit", "mse", "elements", dict(pp=2, tp=2, microbatches=2)),
    ("credit", "mse", "elements", dict(pp=2, dp_shard=2, microbatches=2)),
    # Declared TP under FSDP (2-D parameters) and full activation checkpointing, without PP.
    ("credit", "mse", "elements", dict(tp=2, dp_shard=2, microbatches=2, activation_checkpoint="full")),
    # The 1x1-conv pair inside a "replicate_input" sub-block: still one all-reduce each way.
    ("credit_ri", "l1", "elements", dict(pp=2, tp=2, microbatches=2)),
    ("vit", "cross_entropy", "elements", dict(pp=2, tp=2, microbatches=2)),
    ("vit", focal_sum, "elements", dict(pp=2, dp_shard=2, microbatches=2)),
    ("vit", focal_sum, "samples", dict(pp=2, tp=2, microbatches=4, schedule="GPipe")),
]


CREDIT_TOML = os.path.join(REPO, "toml_configs", "credit_cpu.toml")
VIT_TOML = os.path.join(REPO, "toml_configs", "vit_cpu.toml")
TRAIN_STEPS = ["training.steps=8", "training.log_every=1", 'training.metrics_file=""', "training.warmup_steps=1"]
# The shipped ViT job (its model, labelled images and cross-entropy from the TOML) at pp2 x dp2 FSDP, smaller.
VIT_FSDP = ["parallel.tp=1", "parallel.dp_shard=2", "parallel.microbatches=2", "training.batch_size=8", "model.dim=32"]


def _all_cases() -> tuple[list[dict], list[float], int]:
    """Every parity case, the shipped CREDIT TOML trained for a few steps (its losses), then `pp-tp parity`'s
    per-rank run on the shipped ViT TOML at pp2 x dp2 FSDP (0 when every step passes the float64 verdict)."""
    parity = [_compare(kind, loss, norm, **kw) for kind, loss, norm, kw in CASES]
    rows = train(load_config(CREDIT_TOML, TRAIN_STEPS))
    vit = load_config(VIT_TOML, VIT_FSDP)
    return parity, [r["loss"] for r in rows], run_parity(vit, 2, mesh=pp_tp.build_mesh(vit.parallel))


def test_nonlm_parity_tp_collectives_and_shipped_tomls(world):
    out = world(4).run(_all_cases)
    per_rank = [o[0] for o in out]
    losses = out[0][1]
    assert len(losses) == 8 and losses[-1] < 0.7 * losses[0], losses  # MSE on the synthetic fields falls
    assert [o[2] for o in out] == [0] * 4  # the ViT from its TOML: loss, grads, params like its plain build
    for i, (kind, loss, norm, kw) in enumerate(CASES):
        results = [r[i] for r in per_rank]
        try:
            assert_parity(results)
        except AssertionError as e:
            raise AssertionError(f"{kind} {loss} {norm} {kw}: {e}") from None
        assert results[0]["losses"][1] < results[0]["losses"][0], results[0]["losses"]
        if kw.get("tp", 1) > 1 and "activation_checkpoint" not in kw:  # (recompute repeats forward all-reduces)
            # one forward and one backward all-reduce per declared pair, block and microbatch
            pairs = 2  # CREDIT: qkv/proj and the 1x1 convs; ViT: its _tp_plan attention and its declared MLP
            for r in results:
                assert r["tp_all_reduces"] == 2 * pairs * r["blocks"] * kw["microbatches"], (kind, r)


# --- single process: refusals in one line ---------------------------------------------------------------------


def _refusal(fn) -> str:
    with pytest.raises(ConfigError) as e:
        fn()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_declared_tp_refusals():
    pc = pcfg_of(tp=2)
    model = _model("credit", "meta")
    check_tp_plan(model, CREDIT, pc)
    model.blocks[1].mlp[0] = nn.Conv2d(32, 64, 3, padding=1)
    msg = _refusal(lambda: check_tp_plan(model, CREDIT, pc))
    assert msg.startswith("block blocks.1 (CreditBlock): _tp_col path 'mlp.0' is a Conv2d with kernel (3, 3)"), msg

    model = _model("credit", "meta")
    model.blocks[0]._tp_row = ["attn.proj"]
    assert "must pair up one to one" in _refusal(lambda: check_tp_plan(model, CREDIT, pc))
    model.blocks[0]._tp_row = ["attn.proj", "mlp.3"]
    assert "_tp_row path 'mlp.3' names no submodule" in _refusal(lambda: check_tp_plan(model, CREDIT, pc))
    model = _model("credit", "meta")
    model.blocks[1].mlp.insert(2, nn.LayerNorm(64))
    model.blocks[1]._tp_row = ["attn.proj", "mlp.3"]
    assert "parameter 'mlp.2.weight' sits in 'mlp' beside" in _refusal(lambda: check_tp_plan(model, CREDIT, pc))
    model = _model("credit", "meta")
    model.blocks[1].mlp[0] = nn.Conv2d(32, 63, 1)  # 63 channels do not split over tp = 2
    assert "blocks.1.mlp.0.weight dim 0 = 63 is not divisible" in _refusal(lambda: check_tp_plan(model, CREDIT, pc))


def test_non_lm_needs_a_loss():
    msg = _refusal(lambda: preflight(_model("credit", "meta"), pcfg_of(stages_per_rank=1), PreflightInputs("cpu")))
    assert "'credit' is not a language model" in msg
    with pytest.raises(ConfigError, match="training.loss = 'hinge' is unknown"):
        SumLoss("hinge")


def test_credit_job_rules_and_planner_refusal():
    assert set(LOSSES) == set(LOSS_NAMES)  # the TOML names and their implementations
    cfg, checked = check_job(load_config(CREDIT_TOML, world_size=4))
    assert [len(s.blocks) for s in checked.plan.stages] == [2, 2]
    msg = _refusal(lambda: check_job(load_config(CREDIT_TOML, ['training.loss=""'], world_size=4)))
    assert "'credit' is not a language model" in msg
    msg = _refusal(lambda: load_config(CREDIT_TOML, ['data.source="synthetic"'], world_size=4))
    assert "model.kind = 'credit' with data.source = 'synthetic'" in msg
    msg = _refusal(lambda: load_config(VIT_TOML, ['data.source="fields"'], world_size=4))
    assert msg.startswith("model.kind = 'vit' with data.source = 'fields': model.kind = \"credit\" with"), msg
    assert "not a language model" in _refusal(lambda: plan_job(cfg, 4))
    lm = os.path.join(REPO, "toml_configs", "debug_cpu.toml")
    assert "drop training.loss" in _refusal(lambda: load_config(lm, ['training.loss="mse"'], world_size=4))
