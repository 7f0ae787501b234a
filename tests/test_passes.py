"""The per-stage passes and their order (TP -> float8 -> AC -> compile -> FSDP): activation checkpointing
really recomputes and keeps names, compile keeps names, and each pass sees what the previous ones made
(float8 through the real torchao converts the TP-sharded Linear layers; tests/test_float8.py has the rest
of float8). A wrong order fails test_a_wrong_pass_order_fails_the_order_check.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import parity_utils as pu
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import pp_tp
from pp_tp.base._torch import is_compiled
from pp_tp.config import ParallelConfig
from pp_tp.config.fsdp_policy import FsdpPolicy
from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.models.reference import REFERENCE
from pp_tp.parallel import apply
from pp_tp.parallel.activation_checkpoint import apply_activation_checkpoint, is_checkpointed
from pp_tp.parallel.compile import apply_compile
from pp_tp.split.plan import plan_stages
from pp_tp.stages.stage_module import StageModule

ATTN_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
FFN_LINEARS = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def whole_stage(model: nn.Module, layout=None, **kw) -> tuple[StageModule, ParallelConfig]:
    """The single stage (pp = 1) holding all of `model`."""
    pcfg = ParallelConfig(dp_shard=1, mixed_precision="fp32", **kw)
    layout = layout or layout_for(model)
    return StageModule(model, layout, plan_stages(model, layout, pcfg).stages[0]), pcfg


def _twin_models(args=pu.TINY) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    a = pu.make_model(args)
    return a, copy.deepcopy(a)


# --- activation checkpointing ----------------------------------------------------------------------


@pytest.mark.parametrize("mode, attn_runs, ffn_runs", [("none", 1, 1), ("full", 2, 2), ("selective", 2, 1)])
def test_activation_checkpoint_recomputes_with_same_names_and_grads(mode, attn_runs, ffn_runs):
    ref_model, model = _twin_models()
    ref, _ = whole_stage(ref_model)
    stage, pcfg = whole_stage(model, activation_checkpoint=mode)
    names = [n for n, _ in stage.named_parameters()]
    assert apply_activation_checkpoint(stage, None, pcfg) is (mode != "none")
    assert [n for n, _ in stage.named_parameters()] == names and set(stage.state_dict()) == set(ref.state_dict())
    runs = {"attn": 0, "ffn": 0}
    for key, fqn in (("attn", "layers.1.attention.wq"), ("ffn", "layers.1.feed_forward.w1")):
        stage.get_submodule(fqn).register_forward_hook(lambda *_, key=key: runs.update({key: runs[key] + 1}))
    ids = torch.randint(0, pu.TINY.vocab_size, (2, 12))
    stage(ids).square().mean().backward()
    ref(ids).square().mean().backward()
    assert runs == {"attn": attn_runs, "ffn": ffn_runs}  # forward, plus the recompute in backward
    for (n, p), (_, q) in zip(stage.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)


def test_selective_checkpoint_finds_the_hf_attention():
    stage, pcfg = whole_stage(pu.make_hf_llama(pu.TINY), activation_checkpoint="selective")
    apply_activation_checkpoint(stage, None, pcfg)
    block = stage.block_modules()[0]
    assert is_checkpointed(block.self_attn) and not is_checkpointed(block) and not is_checkpointed(block.mlp)


def test_selective_checkpoint_without_attention_module_is_refused():
    stage, pcfg = whole_stage(pu.make_model(), replace(REFERENCE, attention="attn"), activation_checkpoint="selective")
    with pytest.raises(ConfigError, match=r"^parallel\.activation_checkpoint = \"selective\".*'attn'"):
        apply_activation_checkpoint(stage, None, pcfg)


# --- compile ---------------------------------------------------------------------------------------


def test_compile_is_per_block_and_keeps_names():
    stage, pcfg = whole_stage(pu.make_model(device="meta"), compile=True)
    names = [n for n, _ in stage.named_parameters()]
    first = stage.block_modules()[0]
    assert apply_compile(stage, None, replace(pcfg, compile=False)) is False and not is_compiled(first)
    assert apply_compile(stage, None, pcfg) is True
    assert all(is_compiled(b) for b in stage.block_modules()) and not is_compiled(stage)
    assert [n for n, _ in stage.named_parameters()] == names


# --- the order of the passes -----------------------------------------------------------------------


def _snapshot(stage: StageModule) -> dict:
    block = stage.block_modules()[0]
    return {
        "tp_sharded": isinstance(block.attention.wq.weight, DTensor),
        "float8": sum(_is_float8(m) for m in block.modules()),
        "checkpointed": is_checkpointed(block),
        "compiled": is_compiled(block),
        "fsdp": isinstance(block, FSDPModule) and isinstance(stage, FSDPModule),
    }


def _is_float8(m: nn.Module) -> bool:
    return type(m).__name__ == "Float8Linear"


def pass_order_case(order: tuple[str, ...] = ()) -> dict:
    """Runs parallelize_stage with every pass on (pp1 x tp2 x dp2), recording what each pass finds on entry;
    `order` (pass names) runs them in another order, to show the check below catches it."""
    pcfg = pu.pcfg_of(
        tp=2,
        dp_shard=2,
        schedule="1F1B",
        microbatches=2,
        float8=True,
        activation_checkpoint="full",
        compile=True,
        embedding="replicate",  # what preflight resolves "auto" to for this untied model; no preflight runs here
    )
    model = pu.make_model(device="meta")
    stage = StageModule(model, REFERENCE, plan_stages(model, REFERENCE, pcfg).stages[0])
    seen: list[tuple[str, dict]] = []
    converted: list[tuple[str, tuple[int, ...]]] = []

    def recording(name, fn):
        def run(stage, mesh, pcfg, *policy):
            seen.append((name, _snapshot(stage)))
            changed = fn(stage, mesh, pcfg, *policy)
            if name == "float8":
                w = [m.weight for m in stage.modules() if _is_float8(m)]
                converted.extend((type(p).__name__, tuple(getattr(p, "_local_tensor", p).shape)) for p in w)
            return changed

        return run

    passes = apply.PASSES
    by_name = dict(passes)
    apply.PASSES = tuple((name, recording(name, by_name[name])) for name in (order or [n for n, _ in passes]))
    try:
        changed = apply.parallelize_stage(stage, pp_tp.build_mesh(pcfg), pcfg, FsdpPolicy.for_rank(pcfg, 0))
    finally:
        apply.PASSES = passes
    return {
        "seen": seen,
        "after": _snapshot(stage),
        "changed": changed,
        "converted": converted,
        "fqns": [fqn for fqn, m in stage.named_modules() if _is_float8(m)],
    }


ORDER = ["tp", "float8", "activation_checkpoint", "compile", "fsdp"]


def check_order(r: dict) -> None:
    """What each pass must find on entry: TP shards first, float8 converts TP's shards, AC wraps the converted
    block, compile sees the checkpointed block, FSDP shards the compiled, checkpointed block."""
    # no experts and cp = 1: those two passes run and change nothing
    assert [name for name, _ in r["seen"]] == ["tp", "experts", "context_parallel", *ORDER[1:]]
    assert r["changed"] == ORDER
    seen = dict(r["seen"])
    off = {"tp_sharded": False, "float8": 0, "checkpointed": False, "compiled": False, "fsdp": False}
    assert seen["tp"] == off
    assert seen["experts"] == seen["context_parallel"] == {**off, "tp_sharded": True}
    assert seen["float8"] == {**off, "tp_sharded": True}
    assert seen["activation_checkpoint"] == {**seen["float8"], "float8": 2}
    assert seen["compile"] == {**seen["activation_checkpoint"], "checkpointed": True}
    assert seen["fsdp"] == {**seen["compile"], "compiled": True}
    assert r["after"] == {**seen["fsdp"], "fsdp": True}
    # float8 judged the TP-local shapes: of wq [16,32] wk/wv [8,32] wo [32,16] w1/w3 [24,32] w2 [32,24]
    # only wq and wo have both dims divisible by 16 (unsharded, all seven would qualify).
    assert r["fqns"] == [f"layers.{i}.attention.{w}" for i in range(4) for w in ("wq", "wo")]
    assert r["converted"] == [("DTensor", (16, 32)), ("DTensor", (32, 16))] * 4


def test_passes_run_in_order_and_each_sees_the_previous(world):
    for r in world(4).run(pass_order_case):
        check_order(r)


def test_a_wrong_pass_order_fails_the_order_check(world):
    """float8 before TP converts all seven Linear layers by their unsharded shapes, five of whose TP shards
    a float8 GPU matmul refuses (dims not divisible by 16)."""
    wrong = ("float8", "tp", "activation_checkpoint", "compile", "fsdp")
    for r in world(4).run(pass_order_case, wrong):
        assert len(r["fqns"]) == 4 * 7
        with pytest.raises(AssertionError):
            check_order(r)
