"""float8 through the real torchao (0.18.0) on CPU: which Linear layers convert, where it is refused, and
pipelined float8 steps (pp2 x tp2, pp2 x dp2 FSDP, FSDP with float8 all-gather) against two references.

1. The same float8 model in one process, run microbatch by microbatch as the pipeline cuts the batch:
   float8 scaling is dynamic and tensorwise, and the amax of a TP-sharded weight or activation is
   taken over the whole tensor (a DTensor reduction), so parallelism must not change a single scale.
   Tolerance: fp32 summation order only, 1e-5.
2. The same model without float8 (torchao's default recipe: e4m3 inputs and weights, e5m2 output
   gradients). Rounding to nearest with m mantissa bits errs by at most u = 2^-(m+1) relative per
   element: u = 2^-4 for e4m3, 2^-3 for e5m2. A length-K dot product of operands with independent
   uniform rounding errors errs, norm-wise, by about sqrt(K * (u_a^2 + u_b^2) / 3) / sqrt(K), i.e.
   u4 * sqrt(2/3) = 5.1 % forward and sqrt((u4^2 + u5^2) / 3) = 8.1 % for both backward matmuls.
   The head (not converted) sees hidden states that went through 4 blocks whose residual stream carries
   most of the signal; gradients pass through at most one e5m2 cast per layer on their way to a weight.
   Bounds used: loss <= u4 = 6.25 % (a mean over tokens averages element errors away), every full
   gradient <= 2 * 8.1 % ~= 2 * u5 = 25 % (two float8 matmuls compound on the way to a weight).
   And float8 must be visible: the gradients differ from fp32 by more than 1e-3 (fp32 noise is 1e-7).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import parity_utils as pu
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.parallel import float8
from pp_tp.split.plan import plan_stages
from pp_tp.stages.stage_module import StageModule

# Every Linear's TP-local shape (tp = 2) has both dims divisible by 16, so tp = 1 and tp = 2 convert the same set.
F8 = replace(pu.TINY, vocab_size=128, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=64)
U_E4M3, U_E5M2 = 2.0**-4, 2.0**-3
LOSS_TOL, GRAD_TOL = U_E4M3, 2 * U_E5M2
ROWS, SEQ = 8, 16


def whole_stage(model: nn.Module, **kw) -> tuple[StageModule, ParallelConfig]:
    """The single stage (pp = 1) holding all of `model`."""
    pcfg = ParallelConfig(dp_shard=1, mixed_precision="fp32", **kw)
    layout = layout_for(model)
    return StageModule(model, layout, plan_stages(model, layout, pcfg).stages[0]), pcfg


# --- single process ---------------------------------------------------------------------------------------


def test_float8_filter_dims_divisible_by_16_never_the_head():
    stage, _ = whole_stage(pu.make_model(device="meta"))
    linears = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1")
    linears += ("feed_forward.w2", "feed_forward.w3")
    assert float8.float8_fqns(stage) == [f"layers.{i}.{m}" for i in range(4) for m in linears]
    assert stage.output.weight.shape[0] % 16 == 0  # the head would qualify by shape: it is left out by name
    odd, _ = whole_stage(pu.make_model(replace(pu.TINY, ffn_dim=40), device="meta"))
    assert float8.float8_fqns(odd) == [f"layers.{i}.{m}" for i in range(4) for m in linears[:4]]


def test_float8_swap_is_torchao_and_keeps_names_params_and_hooks():
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    model = pu.make_model(F8)
    stage, pcfg = whole_stage(model, float8=True)
    assert float8.apply_float8(stage, None, replace(pcfg, float8=False)) is False
    wq = stage.get_submodule("layers.0.attention.wq")
    weight, names = wq.weight, [n for n, _ in stage.named_parameters()]
    calls = []
    wq.register_forward_pre_hook(lambda mod, args: calls.append(type(mod).__name__))  # as TP's styles do
    assert float8.apply_float8(stage, None, pcfg) is True
    new = stage.get_submodule("layers.0.attention.wq")
    assert isinstance(new, Float8Linear) and new.weight is weight and type(stage.output) is nn.Linear
    assert [n for n, _ in stage.named_parameters()] == names
    ids = torch.randint(0, F8.vocab_size, (2, 16))
    stage(ids).sum().backward()
    assert calls == ["Float8Linear"] and weight.grad is not None


def test_float8_is_refused_where_it_cannot_run(monkeypatch):
    pcfg = ParallelConfig(float8=True, dp_shard=1)
    float8.check_float8(pcfg, "cpu")  # torchao emulates float8 matmuls on CPU
    float8.check_float8(replace(pcfg, float8=False, float8_fsdp_all_gather=True), "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(ConfigError, match=r"^parallel\.float8 = true needs an NVIDIA GPU[^\n]*\(8, 0\)"):
        float8.check_float8(pcfg, "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    float8.check_float8(pcfg, "cuda")
    for bad in (
        replace(pcfg, float8_fsdp_all_gather=True),
        replace(pcfg, dp_shard=2, tp=2, float8_fsdp_all_gather=True),
    ):
        with pytest.raises(ConfigError, match=r"^parallel\.float8_fsdp_all_gather = true needs FSDP without TP"):
            float8.check_float8(bad, "cpu")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^parallel\.float8 = true needs torchao[^\n]*$"):
        float8.check_float8(pcfg, "cpu")


# --- multi-rank --------------------------------------------------------------------------------------------


def _float8_reference(state: dict, ids: torch.Tensor, labels: torch.Tensor, cuts: int) -> dict:
    """One process, float8 converted as the pipeline converts it, run over the same `cuts` row blocks."""
    model = pu.make_model(F8)
    model.load_state_dict(state, strict=False)
    stage, pcfg = whole_stage(model, float8=True)
    float8.apply_float8(stage, None, pcfg)
    n = (labels != -100).sum()
    loss = 0.0
    for i, lab in zip(ids.chunk(cuts), labels.chunk(cuts)):
        mb = F.cross_entropy(stage(i).flatten(0, 1), lab.flatten(), ignore_index=-100, reduction="sum") / n
        mb.backward()
        loss += mb.item()
    return {"losses": [loss], "grads": {k: p.grad for k, p in stage.named_parameters()}}


def _errors(got: dict, ref: dict) -> tuple[float, float]:
    loss = abs(got["losses"][0] - ref["losses"][0]) / abs(ref["losses"][0])
    return loss, max(pu.rel_err(g, ref["grads"][k]) for k, g in got["grads"].items())


def float8_case(refs: dict, **kw) -> dict:
    """A float8 pipeline step vs the one-process float8 model (same microbatches) and vs fp32 without float8; both
    references are kept in `refs` for the next case (same weights and batch: only the microbatch cuts can differ)."""
    pcfg = pu.pcfg_of(schedule="1F1B", microbatches=2, float8=True, **kw)
    state = pu.reference_state(F8)
    ids, labels = pu.batch(F8, ROWS, SEQ)
    got = pu.run_pipeline(pcfg, copy.deepcopy(state), ids, labels, F8)
    converted = sum(type(m).__name__ == "Float8Linear" for part in got["pipe"].model_parts for m in part.modules())
    gathered_in_float8 = any(
        type(p.to_local() if isinstance(p, DTensor) else p).__name__ == "WeightWithDynamicFloat8CastTensor"
        for part in got["pipe"].model_parts
        for p in part.parameters()
    )
    cuts = pcfg.dp * pcfg.microbatches
    if cuts not in refs:
        refs[cuts] = _float8_reference(state, ids, labels, cuts)
    same_f8 = refs[cuts]
    if "fp32" not in refs:
        refs["fp32"] = pu.reference_run(state, ids, labels, F8)
    fp32 = refs["fp32"]
    return {
        "vs_float8": _errors(got, same_f8),
        "vs_fp32": _errors(got, fp32),
        "converted": converted,
        "gathered_in_float8": gathered_in_float8,
    }


F8_CASES = [
    ({"pp": 2, "tp": 2}, False),
    ({"pp": 2, "dp_shard": 2}, False),
    ({"pp": 2, "dp_shard": 2, "float8_fsdp_all_gather": True}, True),
]


def float8_cases() -> list[dict]:
    refs: dict = {}
    return [float8_case(refs, **kw) for kw, _ in F8_CASES]


def test_float8_pipeline_steps_match_one_process_float8_and_fp32_within_float8_precision(world):
    for per_case in world(4).run(float8_cases):
        for (kw, all_gather), r in zip(F8_CASES, per_case):
            assert r["converted"] == 2 * 7, (kw, r)  # this rank's 2 blocks, all 7 Linear layers each
            assert r["gathered_in_float8"] is all_gather, (kw, r)
            loss8, grad8 = r["vs_float8"]
            assert loss8 <= 1e-5 and grad8 <= 1e-5, (kw, r)
            loss32, grad32 = r["vs_fp32"]
            assert loss32 <= LOSS_TOL and grad32 <= GRAD_TOL, (kw, r)
            assert grad32 > 1e-3, (kw, r)  # float8 really ran
