"""Persistent buffers (router biases, activation constants) reach every stage with the model's value from every
source, nothing is left as uninitialized memory, and every rank reaches one verdict.

Families from their own default config shrunk by the self-check's rule (tests/test_hf_families.py `make`):
pipelined against the model's own run (loss, every full gradient, parameters after each AdamW step, every persistent
buffer; two steps in the first case of each layout kind, one in the other), with buffers moved off their init so a stage
that kept `to_empty` memory or the init fails.
"""

from __future__ import annotations

import os
import tempfile

import parity_utils as pu
import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers as T
from hf_utils import assert_exact, seeded_state
from test_hf_families import make, run_all
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import pp_tp
from pp_tp.base.tensors import persistent_buffers
from pp_tp.errors import ConfigError
from pp_tp.models.hf import self_check
from pp_tp.models.hf.layout import compose
from pp_tp.models.hf.record import Record
from pp_tp.models.hf.small import small_config
from pp_tp.preflight.verdict import agreed

DP = dict(pp=2, dp_shard=2)
# Router biases and MLA across schedules (GLM-4.5-MoE, DeepSeek-V2 and Dots1 run in tests/test_family_sweep.py and
# bench/family_sweep.py).
CASES = [
    ("deepseek_v3", dict(**DP, schedule="Interleaved1F1B", microbatches=2)),
    ("exaone_moe", dict(**DP, schedule="ZBVZeroBubble", microbatches=4, steps=1)),
    ("minimax_m2", dict(**DP, schedule="GPipe", microbatches=2, steps=1)),
    ("apertus", dict(**DP, schedule="1F1B", microbatches=2, steps=1)),  # XIELU params (under TP its MLP runs whole)
]
WITH_BUFFERS = {"deepseek_v3", "exaone_moe", "minimax_m2", "apertus"}


def test_buffer_and_mla_families_match_their_own_forward(world):
    results = world(4).run(run_all, CASES)
    assert_exact(results, CASES)
    for (name, _), per_pp in zip(CASES, zip(*results)):
        if name in WITH_BUFFERS:  # the comparison really covered buffers on every rank
            assert all(r["buffers"] > 0 for r in per_pp), (name, per_pp)


# --- every source, at pp2 (each rank one stage) ----------------------------------------------------


def _glm(device: str = "cpu") -> torch.nn.Module:
    model = make("glm4_moe", device)
    if device != "meta":
        model.load_state_dict(seeded_state(model), strict=False)
    return model


def _stage_buffers(pipe) -> dict[str, torch.Tensor]:
    return {k: b.detach().clone() for part in pipe.model_parts for k, b in persistent_buffers(part).items()}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return bool(got) and all(torch.equal(b, want[k]) for k, b in got.items())


def _sources_case(folder: str) -> dict:
    pcfg = pu.pcfg_of(pp=2, schedule="GPipe", microbatches=1)
    mesh = pp_tp.build_mesh(pcfg)
    model = _glm()
    want = {k: b.clone() for k, b in persistent_buffers(model).items()}
    out: dict = {}
    out["model"] = _same(_stage_buffers(pp_tp.build_pipeline(_glm(), mesh, pcfg)), want)
    state = model.state_dict()
    pipe = pp_tp.build_pipeline(_glm("meta"), mesh, pcfg, state_dict=state)
    out["state_dict"] = _same(_stage_buffers(pipe), want)
    # DCP: the buffers are part of the model state; a resume restores them.
    part_state = {k: v for part in pipe.model_parts for k, v in get_model_state_dict(part).items()}
    out["dcp_keys"] = all(k in part_state for k in _stage_buffers(pipe))
    dcp.save({"model": part_state}, checkpoint_id=os.path.join(folder, "dcp"))
    for part in pipe.model_parts:
        for b in persistent_buffers(part).values():
            b.fill_(7.0)
    dcp.load({"model": part_state}, checkpoint_id=os.path.join(folder, "dcp"))
    for part in pipe.model_parts:
        set_model_state_dict(part, part_state)
    out["dcp"] = _same(_stage_buffers(pipe), want)
    # HF safetensors in (checkpoint=) and out (save_pretrained, read back by transformers). A dense family with
    # buffers: transformers stores MoE experts per expert on disk, which checkpoint= refuses in one line.
    apertus = make("apertus")
    apertus.load_state_dict(seeded_state(apertus), strict=False)
    hf_in, hf_out = os.path.join(folder, "hf_in"), os.path.join(folder, "hf_out")
    if torch.distributed.get_rank() == 0:
        apertus.save_pretrained(hf_in)
    torch.distributed.barrier()
    pipe = pp_tp.build_pipeline(make("apertus", "meta"), mesh, pcfg, checkpoint=hf_in)
    want_apertus = persistent_buffers(apertus)
    out["checkpoint"] = _same(_stage_buffers(pipe), want_apertus)
    pipe.save_pretrained(hf_out)
    loaded = T.AutoModelForCausalLM.from_pretrained(hf_out, dtype=torch.float32)
    out["save_pretrained"] = _same(persistent_buffers(loaded), want_apertus)
    # No source: the model's own init rule (_init_weights zeroes the router bias), never to_empty's memory.
    seeded = _stage_buffers(pp_tp.build_pipeline(_glm("meta"), mesh, pcfg))
    out["seeded_zero"] = bool(seeded) and all(not b.any() for b in seeded.values())
    # A source without a buffer is one line naming it, on every rank (only the last stage holds layer 3).
    missing = "model.layers.3.mlp.gate.e_score_correction_bias"
    try:
        pp_tp.build_pipeline(_glm("meta"), mesh, pcfg, state_dict={k: v for k, v in state.items() if k != missing})
        out["missing"] = None
    except ConfigError as e:
        out["missing"] = str(e)
    return out


def test_buffers_come_from_every_source_and_a_missing_one_is_refused_on_every_rank(world):
    with tempfile.TemporaryDirectory() as folder:
        results = world(2).run(_sources_case, folder)
    for r in results:
        assert {k: v for k, v in r.items() if k != "missing"} == {
            "model": True,
            "state_dict": True,
            "dcp_keys": True,
            "dcp": True,
            "checkpoint": True,
            "save_pretrained": True,
            "seeded_zero": True,
        }, r
    assert results[0]["missing"] == results[1]["missing"]
    assert "state_dict has no 'model.layers.3.mlp.gate.e_score_correction_bias'" in results[0]["missing"]


def test_a_checkpoint_without_a_buffer_is_refused_before_any_collective(tmp_path):
    from safetensors.torch import load_file, save_file

    from pp_tp.hf_checkpoint import open_checked

    make("apertus").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.act_fn.beta"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"missing 'model.layers.1.mlp.act_fn.beta'"):
        open_checked(str(tmp_path), make("apertus", "meta"))


def _seeded_apertus() -> str:
    pcfg = pu.pcfg_of(pp=2, schedule="GPipe", microbatches=1)
    try:
        pp_tp.build_pipeline(make("apertus", "meta"), pp_tp.build_mesh(pcfg), pcfg)
    except ConfigError as e:
        return str(e)
    return ""


def test_a_buffer_no_rule_initializes_is_refused_by_name_on_every_rank(world):
    """XIELU's beta/eps are set only in its constructor, which a meta build never ran: refused, not left empty."""
    first, second = world(2).run(_seeded_apertus)
    assert first == second and "persistent buffer 'model.layers." in first and "act_fn.beta" in first, first


# --- one verdict ---------------------------------------------------------------------------------------


def _crash_on_rank_1() -> str:
    def work() -> int:
        if torch.distributed.get_rank() == 1:
            raise KeyError("boom")
        return 1

    try:
        agreed(work)
    except Exception as e:  # noqa: BLE001 - the test looks at what each rank saw
        return f"{type(e).__name__}: {e}"
    return "went on"


def test_a_crash_on_one_rank_ends_every_rank_with_its_name(world):
    first, second = world(2).run(_crash_on_rank_1)
    assert first.startswith("RuntimeError: rank 1 failed while building the pipeline (KeyError: 'boom')"), first
    assert second == "KeyError: 'boom'"


# --- the self-check ------------------------------------------------------------------------------------


def test_the_self_check_is_deterministic_and_leaves_the_rng_alone():
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(small_config(T.DeepseekV3Config()))
    small = small_config(model.config)
    assert (small.head_dim, small.qk_head_dim) == (small.qk_rope_head_dim, 16)  # MLA dims stay consistent
    torch.manual_seed(123)
    before = torch.get_rng_state()
    verdicts = {self_check._verdict(Record(type(model), small), compose) for _ in "ab"}  # two records, built afresh
    assert torch.equal(torch.get_rng_state(), before)
    assert verdicts == {None}


def test_an_unsupported_tp_style_is_named_without_blaming_experts():
    from pp_tp.models.hf.tp_plan import block_tp_plan

    config = small_config(T.LlamaConfig())
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.self_attn": "mystery_rule"}
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(config)
    _, why = block_tp_plan(model, "layers", list(model.model.layers))
    assert "'mystery_rule'" in why and "experts" not in why, why


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool])
def test_a_poisoned_buffer_of_any_dtype_is_seen_until_written(dtype):
    from pp_tp.materialize.local_stages import _is_poisoned, _poison

    b = torch.empty(5, dtype=dtype)
    _poison(b)
    assert _is_poisoned(b)
    b[1:] = torch.zeros(4, dtype=dtype)  # partly written: still refused
    assert _is_poisoned(b)
    b.copy_(torch.zeros(5, dtype=dtype))  # zeros are a real value for every dtype
    assert not _is_poisoned(b)
