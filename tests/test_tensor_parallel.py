"""Tensor parallelism inside pipeline stages (no sequence parallel): plans, checks, and multi-rank parity
against the single-process non-PP, non-TP build on the same weights and batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import pp_tp
from parity_utils import TINY, assert_parity, batch, compare, make_model, mesh_for, pcfg_of
from pp_tp.errors import ConfigError
from pp_tp.parallel.tensor_parallel import block_plan, check_tp_plan, verify
from pp_tp.stages.layouts import HF_LLAMA, REFERENCE
from pp_tp.stages.plan import plan_stages
from pp_tp.stages.stage_module import StageModule

QKB = dataclasses.replace(TINY, qk_norm=True, attn_bias=True)  # GQA: 4 heads, 2 kv heads
QKB8 = dataclasses.replace(QKB, n_heads=8, n_kv_heads=4)  # tp = 4 needs 4 kv heads
HF_BIAS = dataclasses.replace(TINY, attn_bias=True)  # LlamaForCausalLM has no q/k norms
VOCAB_PAR = dict(embedding="vocab_parallel", loss_parallel=True)


# --- declared plans and verify (single process, meta models) -----------------------------------------

class _Block(nn.Module):
    _tp_plan = {"attn.*": "colwise", "out": "rowwise", "missing": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.ModuleDict({"q": nn.Linear(8, 8), "k": nn.Linear(8, 8)})
        self.out = nn.Linear(8, 8)
        self.gate = nn.Linear(8, 2)


def test_block_class_tp_plan_wins_and_verify_reports():
    block = _Block()
    assert block_plan(block, REFERENCE) == _Block._tp_plan
    report = verify(block, block_plan(block, REFERENCE))
    assert report.resolved == {"attn.q": "colwise", "attn.k": "colwise", "out": "rowwise"}
    assert report.unmatched_rules == ["missing"]
    assert report.unsharded_linears == ["gate"]
    assert not report.ok
    ok = verify(block, {"attn.*": "colwise", "out": "rowwise", "gate": "replicate"})
    assert ok.ok and ok.resolved["gate"] == "replicate"


def test_unknown_style_is_one_line_config_error():
    with pytest.raises(ConfigError, match=r"'out': style 'row' is unknown; use one of colwise, ") as e:
        verify(_Block(), {"out": "row"})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("hf", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_builtin_layout_plans_cover_every_linear(hf, qk_norm):
    args = dataclasses.replace(QKB, qk_norm=qk_norm)
    model = make_model(args, hf, device="meta")
    layout = HF_LLAMA if hf else REFERENCE
    block = model.get_submodule(layout.blocks)[0 if hf else "0"]
    plan = block_plan(block, layout)
    report = verify(block, plan)
    assert report.ok, report
    norms = {n for n, s in plan.items() if s == "replicated_with_grad_allreduce"}
    # HF LlamaDecoderLayer has no q/k norms whatever the flag; the reference block has them with qk_norm.
    assert norms == ({"attention.q_norm", "attention.k_norm"} if qk_norm and not hf else set())
    assert sum(s == "colwise" for s in plan.values()) == 5 and sum(s == "rowwise" for s in plan.values()) == 2


def test_check_tp_plan_refuses_bad_declared_plans_before_building():
    model = make_model(TINY, device="meta")
    model.layers["2"]._tp_plan = {**REFERENCE.tp_plan, "attention.wqq": "colwise"}
    with pytest.raises(ConfigError, match=r"rule 'attention.wqq' matches no module of block layers.2 "):
        check_tp_plan(model, REFERENCE, pcfg_of(tp=2))
    check_tp_plan(model, REFERENCE, pcfg_of(tp=1))  # nothing to shard, nothing to check

    odd = make_model(dataclasses.replace(TINY, ffn_dim=50), device="meta")  # ffn 50 splits by 2, not by 4
    check_tp_plan(odd, REFERENCE, pcfg_of(tp=2))
    with pytest.raises(ConfigError, match=r"layers.0.feed_forward.w1.weight dim 0 = 50 is not divisible by "
                                          r"parallel.tp = 4"):
        check_tp_plan(odd, REFERENCE, pcfg_of(tp=4))

    model.layers["2"]._tp_plan = {k: v for k, v in REFERENCE.tp_plan.items() if k != "feed_forward.w3"}
    with pytest.warns(UserWarning, match=r"\['feed_forward.w3'\] match no TP plan rule"):
        check_tp_plan(model, REFERENCE, pcfg_of(tp=2))


def test_stage_outputs_must_be_plain_tensors():
    from torch.testing._internal.two_tensor import TwoTensor  # a wrapper subclass like DTensor, without a mesh

    model = make_model(TINY)
    plan = plan_stages(model, REFERENCE, pcfg_of(pp=2))
    first, last = (StageModule(model, REFERENCE, s) for s in plan.stages)
    ids, _ = batch(TINY, 2, 8)
    h = first(ids)
    assert type(h) is torch.Tensor and type(last(h)) is torch.Tensor
    for stage, layer in ((first, "1"), (last, "3")):
        stage.layers[layer].register_forward_hook(lambda mod, inp, out: TwoTensor(out, out.clone()))
    for stage, x in ((first, ids), (last, h)):
        with pytest.raises(TypeError, match=r"outputs a TwoTensor; stage boundaries carry plain torch.Tensor"):
            stage(x)


# --- multi-rank parity ---------------------------------------------------------------------------------

def _parity_cases(cases: list[tuple]) -> list[dict]:
    """Each case: (model args, hf, ParallelConfig kwargs); 3 AdamW steps each."""
    return [compare(pcfg_of(**kw), args=args, hf=hf, steps=3) for args, hf, kw in cases]


def _assert_all(per_rank: list[list[dict]], cases: list[tuple]) -> None:
    for i, case in enumerate(cases):
        try:
            assert_parity([r[i] for r in per_rank], tol=1e-5)
        except AssertionError as e:
            raise AssertionError(f"{case}: {e}") from None


def test_tp2_parity(world):
    cases = [
        (QKB, False, dict(tp=2, microbatches=2)),  # replicated embedding, gathered logits
        (QKB, False, dict(tp=2, microbatches=2, **VOCAB_PAR)),
        (HF_BIAS, True, dict(tp=2, microbatches=2, **VOCAB_PAR)),  # HF LlamaForCausalLM
    ]
    _assert_all(world(2).run(_parity_cases, cases), cases)


def test_tp4_and_pp2_tp2_parity(world):
    embed_alone = [["tok_embeddings"], ["layers.0", "layers.1", "layers.2", "layers.3", "norm", "output"]]
    cases = [
        (QKB8, False, dict(tp=4, microbatches=2, **VOCAB_PAR)),
        (QKB, False, dict(pp=2, tp=2, microbatches=4, **VOCAB_PAR)),
        # Split backward (input/weight) of zero-bubble schedules through DTensor ops.
        (QKB, False, dict(pp=2, tp=2, microbatches=4, schedule="ZBVZeroBubble", stages_per_rank=2)),
        # Stage 0 is only the vocab-parallel embedding: its all-reduced output crosses the boundary.
        (QKB, False, dict(pp=2, tp=2, microbatches=2, split="explicit", stage_fqns=embed_alone,
                          embedding="vocab_parallel")),
        (HF_BIAS, True, dict(pp=2, tp=2, microbatches=2)),
    ]
    _assert_all(world(4).run(_parity_cases, cases), cases)


# --- communication counts ------------------------------------------------------------------------------

class _CollectiveLog(TorchDispatchMode):
    """Records DTensor's communication (functional collectives) as (op name, input shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func._opname != "wait_tensor":
            self.calls.append((func._opname, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


def _count_collectives(microbatches: int, loss_parallel: bool) -> dict:
    pcfg = pcfg_of(tp=2, microbatches=microbatches, loss_parallel=loss_parallel)
    pipe = pp_tp.build_pipeline(make_model(QKB, device="meta"), mesh_for(pcfg), pcfg)
    ids, labels = batch(QKB, 4, 6)  # 6 * microbatch rows never equals head_dim 8
    with _CollectiveLog() as log:
        pipe.step(ids, labels)
    norms = [p for part in pipe.model_parts for n, p in part.named_parameters() if n.endswith(("q_norm.weight",
                                                                                               "k_norm.weight"))]
    head_dim = QKB.dim // QKB.n_heads
    return {
        "norm_grad_all_reduces": sum(op == "all_reduce" and shape == (head_dim,) for op, shape in log.calls),
        "all_gathers": sum(op.startswith("all_gather") for op, _ in log.calls),
        "norm_grad_placements": {str(p.grad.placements) for p in norms},
        "n_norms": len(norms),
    }


def _collective_cases() -> list[dict]:
    return [_count_collectives(m, lp) for m, lp in ((1, False), (4, False), (4, True))]


def test_qk_norm_grads_reduced_once_per_step_and_loss_parallel_never_gathers(world):
    per_rank = world(2).run(_collective_cases)
    for one_mb, four_mb, loss_par in per_rank:
        n_norms = 2 * QKB.n_layers
        for r in (one_mb, four_mb, loss_par):
            # One all-reduce per q/k-norm weight per step, whatever the microbatch count.
            assert r["n_norms"] == n_norms and r["norm_grad_all_reduces"] == n_norms, r
            assert r["norm_grad_placements"] == {"(Replicate(),)"}, r
        # Gathered logits: one all-gather per microbatch forward; loss parallel: none, in forward or backward.
        assert (one_mb["all_gathers"], four_mb["all_gathers"], loss_par["all_gathers"]) == (1, 4, 0)


# --- shape checks before any collective -----------------------------------------------------------------

def _shape_errors() -> list[str]:
    errors = []
    for args in (dataclasses.replace(TINY, n_kv_heads=1), dataclasses.replace(TINY, vocab_size=95)):
        pcfg = pcfg_of(tp=2)
        try:
            pp_tp.build_pipeline(make_model(args, hf=True, device="meta"), mesh_for(pcfg), pcfg)
        except ConfigError as e:
            errors.append(str(e))
    return errors


def test_hf_shapes_not_divisible_by_tp_fail_on_every_rank(world):
    for errors in world(2).run(_shape_errors):
        assert len(errors) == 2
        assert errors[0].startswith("model.n_kv_heads = 1 is not divisible by parallel.tp = 2; ")
        assert errors[1].startswith("model.vocab_size = 95 is not divisible by parallel.tp = 2; ")
