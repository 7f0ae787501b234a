"""The per-stage passes and their order (TP -> float8 -> AC -> compile -> FSDP): activation checkpointing
really recomputes and keeps names, compile keeps names, float8 picks the right Linear layers (of the
TP-sharded stage), keeps TP's hooks and is refused where it cannot run, and each pass sees what the
previous ones made.

torchao is not installable here and float8 matmuls need an NVIDIA GPU of compute capability >= 8.9,
so on CPU a fake converter (same math) stands in; the real conversion runs only on such a GPU.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import replace

import parity_utils as pu
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from pp_tp._torch import is_compiled
from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.models.reference import REFERENCE
from pp_tp.parallel import apply, float8
from pp_tp.parallel.activation_checkpoint import apply_activation_checkpoint, is_checkpointed
from pp_tp.parallel.compile import apply_compile
from pp_tp.stages.layouts import layout_for
from pp_tp.stages.plan import plan_stages
from pp_tp.stages.stage_module import StageModule

ATTN_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
FFN_LINEARS = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


class FakeFloat8Linear(nn.Linear):
    """Stands in for torchao's Float8Linear on CPU: a new module object with the same math and parameters."""

    @classmethod
    def from_float(cls, mod: nn.Linear) -> FakeFloat8Linear:
        new = cls(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
        new.weight, new.bias = mod.weight, mod.bias
        return new


def fake_converter(pcfg: ParallelConfig):
    return FakeFloat8Linear.from_float


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
    block = stage.blocks()[0]
    assert is_checkpointed(block.self_attn) and not is_checkpointed(block) and not is_checkpointed(block.mlp)


def test_selective_checkpoint_without_attention_module_is_refused():
    stage, pcfg = whole_stage(pu.make_model(), replace(REFERENCE, attention="attn"), activation_checkpoint="selective")
    with pytest.raises(ConfigError, match=r"^parallel\.activation_checkpoint = \"selective\".*'attn'"):
        apply_activation_checkpoint(stage, None, pcfg)


# --- compile ---------------------------------------------------------------------------------------


def test_compile_is_per_block_and_keeps_names():
    stage, pcfg = whole_stage(pu.make_model(device="meta"), compile=True)
    names = [n for n, _ in stage.named_parameters()]
    assert apply_compile(stage, None, replace(pcfg, compile=False)) is False and not is_compiled(stage.blocks()[0])
    assert apply_compile(stage, None, pcfg) is True
    assert all(is_compiled(b) for b in stage.blocks()) and not is_compiled(stage)
    assert [n for n, _ in stage.named_parameters()] == names


# --- float8 ----------------------------------------------------------------------------------------


def test_float8_filter_dims_divisible_by_16_never_the_head():
    stage, _ = whole_stage(pu.make_model(device="meta"))
    assert float8.float8_fqns(stage) == [f"layers.{i}.{m}" for i in range(4) for m in ATTN_LINEARS + FFN_LINEARS]
    assert stage.output.weight.shape[0] % 16 == 0  # the head would qualify by shape: it is left out by name
    odd, _ = whole_stage(pu.make_model(replace(pu.TINY, ffn_dim=40), device="meta"))
    assert float8.float8_fqns(odd) == [f"layers.{i}.{m}" for i in range(4) for m in ATTN_LINEARS]


def test_float8_swap_keeps_names_params_and_hooks(monkeypatch):
    monkeypatch.setattr(float8, "CONVERTER", fake_converter)
    ref_model, model = _twin_models()
    ref, _ = whole_stage(ref_model)
    stage, pcfg = whole_stage(model, float8=True)
    assert float8.apply_float8(stage, None, replace(pcfg, float8=False)) is False
    wq = stage.get_submodule("layers.0.attention.wq")
    weight = wq.weight
    calls = []
    wq.register_forward_pre_hook(lambda mod, args: calls.append(type(mod).__name__))  # as TP's styles do
    names = [n for n, _ in stage.named_parameters()]
    assert float8.apply_float8(stage, None, pcfg) is True
    new = stage.get_submodule("layers.0.attention.wq")
    assert isinstance(new, FakeFloat8Linear) and new.weight is weight
    assert not isinstance(stage.output, FakeFloat8Linear)
    assert [n for n, _ in stage.named_parameters()] == names
    ids = torch.randint(0, pu.TINY.vocab_size, (2, 12))
    torch.testing.assert_close(stage(ids), ref(ids))
    assert calls == ["FakeFloat8Linear"]


def test_float8_all_gather_only_with_fsdp_and_without_tp():
    assert float8.float8_all_gather(ParallelConfig(dp_shard=2, mixed_precision="fp32"))
    assert not float8.float8_all_gather(ParallelConfig(dp_shard=2, tp=2, mixed_precision="fp32"))
    assert not float8.float8_all_gather(ParallelConfig(dp_shard=1, mixed_precision="fp32"))


def test_float8_is_refused_where_it_cannot_run(monkeypatch):
    pcfg = ParallelConfig(float8=True)
    float8.check_float8(replace(pcfg, float8=False), "cpu")
    if importlib.util.find_spec("torchao") is None:
        with pytest.raises(ConfigError, match=r"^parallel\.float8 = true needs torchao[^\n]*$"):
            float8.check_float8(pcfg, "cpu")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "torchao" else real_find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match=r"^parallel\.float8 = true needs an NVIDIA GPU[^\n]*a CPU"):
        float8.check_float8(pcfg, "cpu")


def build_refuses_float8_case() -> str:
    pcfg = pu.pcfg_of(pp=2, dp_shard=2, schedule="1F1B", microbatches=2, float8=True)
    try:
        pu.pp_tp.build_pipeline(pu.make_model(device="meta"), pu.mesh_for(pcfg), pcfg)
    except ConfigError as e:
        return str(e)
    return "built"


@pytest.mark.skipif(
    torch.cuda.is_available() and importlib.util.find_spec("torchao") is not None, reason="float8 can run here"
)
def test_build_pipeline_refuses_float8_on_this_machine(world):
    for message in world(4).run(build_refuses_float8_case):
        assert message.startswith("parallel.float8 = true needs"), message


@pytest.mark.skipif(
    not (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() >= (8, 9)
        and importlib.util.find_spec("torchao") is not None
    ),
    reason="GPU-only: needs torchao and an NVIDIA GPU of compute capability >= 8.9",
)
def test_float8_real_torchao_conversion_on_gpu():
    ref_model, model = _twin_models(replace(pu.TINY, dim=64, n_heads=4, n_kv_heads=4, ffn_dim=128))
    ref, _ = whole_stage(ref_model.cuda().bfloat16())
    stage, pcfg = whole_stage(model.cuda().bfloat16(), float8=True)
    assert float8.apply_float8(stage, None, pcfg)
    assert type(stage.get_submodule("layers.0.attention.wq")).__name__ == "Float8Linear"
    ids = torch.randint(0, pu.TINY.vocab_size, (4, 32), device="cuda")
    out, want = stage(ids).float(), ref(ids).float()
    assert pu.rel_err(out, want) < 0.1


# --- the order of the passes -----------------------------------------------------------------------


def _snapshot(stage: StageModule) -> dict:
    block = stage.blocks()[0]
    return {
        "tp_sharded": isinstance(block.attention.wq.weight, DTensor),
        "float8": sum(isinstance(m, FakeFloat8Linear) for m in block.modules()),
        "checkpointed": is_checkpointed(block),
        "compiled": is_compiled(block),
        "fsdp": isinstance(block, FSDPModule) and isinstance(stage, FSDPModule),
    }


def pass_order_case() -> dict:
    """Runs parallelize_stage with every pass on (pp1 x tp2 x dp2), recording what each pass finds on entry."""
    pcfg = pu.pcfg_of(
        tp=2, dp_shard=2, schedule="1F1B", microbatches=2, float8=True, activation_checkpoint="full", compile=True
    )
    model = pu.make_model(device="meta")
    stage = StageModule(model, REFERENCE, plan_stages(model, REFERENCE, pcfg).stages[0])
    seen: list[tuple[str, dict]] = []
    converted: list[tuple[str, tuple[int, ...]]] = []

    def recording(name, fn):
        def run(stage, mesh, pcfg):
            seen.append((name, _snapshot(stage)))
            return fn(stage, mesh, pcfg)

        return run

    def converter(pcfg):
        def convert(mod):
            w = mod.weight
            converted.append((type(w).__name__, tuple(w.to_local().shape)))
            return FakeFloat8Linear.from_float(mod)

        return convert

    passes, conv = apply.PASSES, float8.CONVERTER
    apply.PASSES = tuple((name, recording(name, fn)) for name, fn in passes)
    float8.CONVERTER = converter
    try:
        changed = apply.parallelize_stage(stage, pu.mesh_for(pcfg), pcfg)
    finally:
        apply.PASSES, float8.CONVERTER = passes, conv
    return {
        "seen": seen,
        "after": _snapshot(stage),
        "changed": changed,
        "converted": converted,
        "fqns": [fqn for fqn, m in stage.named_modules() if isinstance(m, FakeFloat8Linear)],
    }


ORDER = ["tp", "float8", "activation_checkpoint", "compile", "fsdp"]


def test_passes_run_in_order_and_each_sees_the_previous(world):
    for r in world(4).run(pass_order_case):
        assert [name for name, _ in r["seen"]] == ORDER and r["changed"] == ORDER
        seen = dict(r["seen"])
        # what each pass finds on entry: TP shards first, float8 converts TP's shards, AC wraps the converted
        # block, compile sees the checkpointed block, FSDP shards the compiled, checkpointed block.
        off = {"tp_sharded": False, "float8": 0, "checkpointed": False, "compiled": False, "fsdp": False}
        assert seen["tp"] == off
        assert seen["float8"] == {**off, "tp_sharded": True}
        assert seen["activation_checkpoint"] == {**seen["float8"], "float8": 2}
        assert seen["compile"] == {**seen["activation_checkpoint"], "checkpointed": True}
        assert seen["fsdp"] == {**seen["compile"], "compiled": True}
        assert r["after"] == {**seen["fsdp"], "fsdp": True}
        # float8 judged the TP-local shapes: of wq [16,32] wk/wv [8,32] wo [32,16] w1/w3 [24,32] w2 [32,24]
        # only wq and wo have both dims divisible by 16 (unsharded, all seven would qualify).
        assert r["fqns"] == [f"layers.{i}.attention.{w}" for i in range(4) for w in ("wq", "wo")]
        assert r["converted"] == [("DTensor", (16, 32)), ("DTensor", (32, 16))] * 4


def float8_tp_parity_case() -> list[dict]:
    """A full build with the fake float8 converter on TP-sharded, checkpointed, FSDP-wrapped stages."""
    from pp_tp import preflight

    check, conv = preflight.check_float8, float8.CONVERTER
    preflight.check_float8, float8.CONVERTER = (lambda pcfg, device_type: None), fake_converter
    try:
        pcfg = pu.pcfg_of(
            tp=2, dp_shard=2, schedule="1F1B", microbatches=2, float8=True, activation_checkpoint="selective"
        )
        return pu.compare(pcfg, steps=3)
    finally:
        preflight.check_float8, float8.CONVERTER = check, conv


def test_float8_swap_keeps_tp_hooks_in_a_full_build(world):
    pu.assert_parity(world(4).run(float8_tp_parity_case))
