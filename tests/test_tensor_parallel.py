"""Tensor parallelism inside pipeline stages (no sequence parallel): plans, checks, and multi-rank parity
against the single-process non-PP, non-TP build on the same weights and batch."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from one_trip import run_cases
from parity_utils import TINY, assert_parity, batch, compare, make_model, pcfg_of
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import pp_tp
from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.models.reference import REFERENCE
from pp_tp.parallel.tensor_parallel import block_plan, check_tp_plan, verify
from pp_tp.split.plan import plan_stages
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
    # An input style on a parent does not cover the Linear layers inside it.
    inputs_only = verify(block, {"attn": "replicate_input", "out": "rowwise", "gate": "replicate"})
    assert inputs_only.unsharded_linears == ["attn.q", "attn.k"]


def test_unknown_style_is_one_line_config_error():
    with pytest.raises(ConfigError, match=r"'out': style 'row' is unknown; use one of colwise, ") as e:
        verify(_Block(), {"out": "row"})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("hf", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_builtin_layout_plans_cover_every_linear(hf, qk_norm):
    args = dataclasses.replace(QKB, qk_norm=qk_norm)
    model = make_model(args, hf, device="meta")
    layout = layout_for(model)
    assert layout.name == ("hf" if hf else "reference")
    block = model.get_submodule(layout.blocks)[0 if hf else "0"]
    plan = block_plan(block, layout)
    report = verify(block, plan)
    assert report.ok, report
    norms = {n for n, s in plan.items() if s == "replicated_with_grad_allreduce"}
    # HF LlamaDecoderLayer has no q/k norms whatever the flag; the reference block has them with qk_norm.
    assert norms == ({"attention.q_norm", "attention.k_norm"} if qk_norm and not hf else set())
    assert sum(s == "colwise" for s in plan.values()) == 5 and sum(s == "rowwise" for s in plan.values()) == 2
    inputs = {n for n, s in plan.items() if s == "replicate_input"}
    assert inputs == ({"self_attn", "mlp"} if hf else {"attention", "feed_forward"})


def test_check_tp_plan_refuses_bad_declared_plans_before_building():
    model = make_model(TINY, device="meta")
    model.layers["2"]._tp_plan = {**REFERENCE.tp_plan, "attention.wqq": "colwise"}
    with pytest.raises(ConfigError, match=r"rule 'attention.wqq' matches no module of block layers.2 "):
        check_tp_plan(model, REFERENCE, pcfg_of(tp=2))
    check_tp_plan(model, REFERENCE, pcfg_of(tp=1))  # nothing to shard, nothing to check

    odd = make_model(dataclasses.replace(TINY, ffn_dim=50), device="meta")  # ffn 50 splits by 2, not by 4
    check_tp_plan(odd, REFERENCE, pcfg_of(tp=2))
    with pytest.raises(
        ConfigError,
        match=r"layers.0.feed_forward.w1.weight dim 0 = 50 is not divisible by "
        r"parallel.tp = 4",
    ):
        check_tp_plan(odd, REFERENCE, pcfg_of(tp=4))

    # A Linear left out beside a column-parallel one would read the sharded sub-block's replicated input: refused.
    model.layers["2"]._tp_plan = {k: v for k, v in REFERENCE.tp_plan.items() if k != "feed_forward.w3"}
    with pytest.raises(ConfigError, match=r"parameter 'feed_forward.w3.weight' sits inside a tensor-parallel sub"):
        check_tp_plan(model, REFERENCE, pcfg_of(tp=2))
    # Per-head parameters of an attention module split with its heads: one entry per head (GPT-OSS's sinks) is
    # accepted, and a parameter whose dim 0 the TP degree does not divide is refused.
    attention = model.layers["2"].attention
    attention.register_parameter("sinks", torch.nn.Parameter(torch.zeros(TINY.n_heads, device="meta")))
    model.layers["2"]._tp_plan = {**REFERENCE.tp_plan, "attention": "replicate_input_head_params"}
    check_tp_plan(model, REFERENCE, pcfg_of(tp=2))
    attention.register_parameter("sinks", torch.nn.Parameter(torch.zeros(TINY.n_heads + 1, device="meta")))
    with pytest.raises(
        ConfigError, match=r"layers.2.attention.sinks: \(5,\) cannot be split by heads over parallel.tp"
    ):
        check_tp_plan(model, REFERENCE, pcfg_of(tp=2))
    del attention.sinks
    # A sub-block left whole (no rule in it) runs unsharded on every TP rank: correct, wasteful, warned.
    model.layers["2"]._tp_plan = {k: v for k, v in REFERENCE.tp_plan.items() if not k.startswith("feed_forward")}
    with pytest.warns(UserWarning, match=r"\['feed_forward.w1', 'feed_forward.w2', 'feed_forward.w3'\] match no TP"):
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
    """Each case: (model args, hf, ParallelConfig kwargs); 2 AdamW steps each (the second on updated moments)."""
    return [compare(pcfg_of(**kw), args=args, hf=hf, steps=2) for args, hf, kw in cases]


def _assert_all(per_rank: list[list[dict]], cases: list[tuple]) -> None:
    for i, case in enumerate(cases):
        try:
            assert_parity([r[i] for r in per_rank])
        except AssertionError as e:
            raise AssertionError(f"{case}: {e}") from None


TP2 = [
    (QKB, False, dict(tp=2, microbatches=2)),  # replicated embedding, gathered logits
    (QKB, False, dict(tp=2, microbatches=2, **VOCAB_PAR)),
    (HF_BIAS, True, dict(tp=2, microbatches=2, **VOCAB_PAR)),  # HF LlamaForCausalLM
]


@pytest.fixture(scope="module")
def two_ranks(world) -> dict[str, list]:
    """Every 2-rank case of this file in one round trip (tests/one_trip.py)."""
    cases = [("parity", _parity_cases, (TP2,)), ("counts", _collective_cases, ()), ("shapes", _shape_errors, ())]
    return run_cases(world(2), cases)


def test_tp2_parity(two_ranks):
    _assert_all(two_ranks["parity"], TP2)


def test_tp4_and_pp2_tp2_parity(world):
    embed_alone = [["tok_embeddings"], ["layers.0", "layers.1", "layers.2", "layers.3", "norm", "output"]]
    cases = [
        (QKB8, False, dict(tp=4, microbatches=2, **VOCAB_PAR)),
        # Split backward (input/weight) of zero-bubble schedules through DTensor ops, with the vocab-parallel
        # embedding and loss (pp2 x tp2 on 1F1B: tests/test_schedules.py's FULL layout).
        (QKB, False, dict(pp=2, tp=2, microbatches=4, schedule="ZBVZeroBubble", stages_per_rank=2, **VOCAB_PAR)),
        # Stage 0 is only the vocab-parallel embedding: its all-reduced output crosses the boundary.
        (
            QKB,
            False,
            dict(pp=2, tp=2, microbatches=2, split="explicit", stage_fqns=embed_alone, embedding="vocab_parallel"),
        ),
        (HF_BIAS, True, dict(pp=2, tp=2, microbatches=2)),
    ]
    _assert_all(world(4).run(_parity_cases, cases), cases)


# --- communication counts ------------------------------------------------------------------------------


class _CollectiveLog(TorchDispatchMode):
    """Records DTensor's communication (functional collectives) as (phase, op name, input shape); phase is
    "bwd" inside autograd's backward, "fwd" elsewhere (forward, loss, and the step's end)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[tuple[str, str, tuple[int, ...]]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented  # let DTensor lower its op first, so the collectives inside it are seen too
        if func.namespace == "_c10d_functional" and func._opname not in ("wait_tensor", "_wrap_tensor_autograd"):
            phase = "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"
            self.calls[(phase, func._opname, tuple(args[0].shape))] += 1
        return func(*args, **(kwargs or {}))


ROWS, SEQ = 4, 6  # 4 rows: 1 and 4 microbatches


def _count_collectives(hf: bool, microbatches: int, vocab_parallel: bool) -> dict:
    args = HF_BIAS if hf else QKB
    pcfg = pcfg_of(tp=2, microbatches=microbatches, **(VOCAB_PAR if vocab_parallel else {}))
    pipe = pp_tp.build_pipeline(make_model(args, hf, device="meta"), pp_tp.build_mesh(pcfg), pcfg)
    with _CollectiveLog() as log:
        pipe.step(*batch(args, ROWS, SEQ))
    norms = [
        p
        for part in pipe.model_parts
        for n, p in part.named_parameters()
        if n.endswith(("q_norm.weight", "k_norm.weight"))
    ]
    return {"calls": dict(log.calls), "norm_grad_placements": {str(p.grad.placements) for p in norms}}


_COUNT_CASES = [(False, 1, False), (False, 4, False), (False, 4, True), (True, 1, False), (True, 4, True)]


def _collective_cases() -> list[dict]:
    return [_count_collectives(*case) for case in _COUNT_CASES]


def test_tp_all_reduces_two_forward_two_backward_per_block_and_microbatch(two_ranks):
    for per_case in two_ranks["counts"]:
        for (hf, m, vocab_par), got in zip(_COUNT_CASES, per_case):
            args = HF_BIAS if hf else QKB
            n_layers, rows = args.n_layers, ROWS // m
            hidden, tokens = (rows, SEQ, args.dim), (rows * SEQ, 1)
            expected = {
                # Per block and microbatch: attention out and MLP down (row-parallel); a vocab-parallel embedding
                # adds its lookup's sum per microbatch.
                ("fwd", "all_reduce", hidden): (2 * n_layers + vocab_par) * m,
                # Per block and microbatch: the attention and MLP input gradients (replicate_input); the head's
                # input gradient per microbatch. The embedding's input (token ids) needs none.
                ("bwd", "all_reduce", hidden): (2 * n_layers + 1) * m,
            }
            if not hf:  # the reference block's q/k norms: one all-reduce per weight per step, after the backward
                expected[("fwd", "all_reduce", (args.dim // args.n_heads,))] = 2 * n_layers
            if vocab_par:  # vocab-parallel cross-entropy: max, sum of exp and target logit per microbatch; no gather
                expected[("fwd", "all_reduce", tokens)] = 3 * m
            else:  # gathered logits: one all-gather per microbatch forward
                expected[("fwd", "all_gather_into_tensor", (rows, SEQ, args.vocab_size // 2))] = m
            assert got["calls"] == expected, (hf, m, vocab_par, got["calls"])
            assert got["norm_grad_placements"] == (set() if hf else {"(Replicate(),)"})


# --- shape checks before any collective -----------------------------------------------------------------


def _shape_errors() -> list[str]:
    errors = []
    for args in (dataclasses.replace(TINY, n_kv_heads=1), dataclasses.replace(TINY, vocab_size=95)):
        pcfg = pcfg_of(tp=2)
        try:
            pp_tp.build_pipeline(make_model(args, hf=True, device="meta"), pp_tp.build_mesh(pcfg), pcfg)
        except ConfigError as e:
            errors.append(str(e))
    return errors


def test_hf_shapes_not_divisible_by_tp_fail_on_every_rank(two_ranks):
    for errors in two_ranks["shapes"]:
        assert len(errors) == 2
        assert errors[0].startswith("model.n_kv_heads = 1 is not divisible by parallel.tp = 2; ")
        assert errors[1].startswith("model.vocab_size = 95 is not divisible by parallel.tp = 2; ")
