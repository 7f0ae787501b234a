"""Mixture-of-experts families with expert parallel (parallel.ep) and TP of experts: exact or refused.

Each case runs the family's own forward + backward and two AdamW steps against the pipelined build on the same
weights and a batch with uneven padding across dp ranks, in lockstep (pp_tp/parity/lockstep.py): loss, every full
gradient (experts gathered from their expert-dim shards), every parameter and persistent buffer after each step,
relative error <= 1e-5. Layouts: on 4 ranks pp2 x ep2 over Interleaved1F1B and ZBVZeroBubble (split backward) and
pp2 x tp2 (TP experts) over 1F1B, Interleaved1F1B and ZBVZeroBubble; on 8 ranks, over 1F1B and Interleaved1F1B,
pp2 x ep2 x tp2 (Mixtral; GPT-OSS on the plan pp_tp supplies), HSDP with EP and experts FSDP-sharded over the
ranks EP leaves.
"""

from __future__ import annotations

import parity_utils as pu
import pytest
import torch
import torch.distributed as dist
from hf_utils import SEQ, VOCAB, assert_exact
from test_hf_families import make, run_all

import pp_tp
from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.models.reference.model import ModelArgs
from pp_tp.preflight import PreflightInputs, preflight

EP = dict(dp_shard=2, ep=2)
TP = dict(tp=2, embedding="vocab_parallel")
# Every named family is also exact in bench/family_sweep.py (--moe-layout ep / tp); CI keeps the distinct paths.
CASES4 = [
    ("mixtral_moe", dict(pp=2, schedule="ZBVZeroBubble", microbatches=4, **EP)),  # EP under a split backward
    ("deepseek_v3", dict(pp=2, schedule="Interleaved1F1B", microbatches=2, **EP)),  # MLA, group routing, bias
    ("qwen2_moe", dict(pp=2, schedule="ZBVZeroBubble", microbatches=4, **TP)),  # a V schedule, gated shared expert
    # MLA split by heads around its whole latents, a dense first layer, shared experts (GLM-4.5 in the sweep)
    ("deepseek_v2", dict(pp=2, schedule="Interleaved1F1B", microbatches=2, **TP)),
    ("deepseek_v3", dict(pp=2, schedule="1F1B", microbatches=2, **TP)),  # the same MLA plan, supplied by pp_tp
]
CASES8 = [
    ("mixtral_moe", dict(pp=2, schedule="1F1B", microbatches=2, **EP, **TP)),  # pp2 x ep2 x tp2
    ("deepseek_v3", dict(pp=2, dp_replicate=2, schedule="Interleaved1F1B", microbatches=2, **EP)),  # HSDP + EP
    ("qwen3_moe", dict(pp=2, dp_shard=4, ep=2, schedule="1F1B", microbatches=2)),  # experts FSDP over 2
    # pp_tp's own plan (its config declares none): sinks by head, sliding layers, biased interleaved experts
    ("gpt_oss", dict(pp=2, schedule="1F1B", microbatches=2, **EP, **TP)),
]


def test_moe_families_exact_with_ep_and_tp_experts(world):
    assert_exact(world(4).run(run_all, CASES4), CASES4)


def test_moe_families_exact_with_ep_tp_and_hsdp_on_8_ranks(world):
    assert_exact(world(8).run(run_all, CASES8), CASES8)


# --- what crosses the wire --------------------------------------------------------------------------------


def _alltoall_case(kw: dict) -> dict:
    """All-to-alls and TP all-reduces one step issues on this rank, and the MoE layers it holds."""
    from pp_tp.diagnostics.comm_ledger import CommLedger

    pcfg = pu.pcfg_of(**kw)
    mesh = pp_tp.build_mesh(pcfg)
    pipe = pp_tp.build_pipeline(make("mixtral_moe", "meta"), mesh, pcfg)
    ids, labels = pu.batch(ModelArgs(vocab_size=VOCAB), 8, SEQ)
    share = slice(pp_tp.parallel.mesh.dp_rank(mesh) * 4, pp_tp.parallel.mesh.dp_rank(mesh) * 4 + 4)
    pipe.step(ids[share], labels[share])  # shapes settled; the ledger sees the step after
    layers = sum(1 for part in pipe.model_parts for n, _ in part.named_modules() if n.endswith("mlp.experts"))
    with CommLedger() as led:
        pipe.step(ids[share], labels[share])
    out = {"layers": layers, "microbatches": pcfg.microbatches, "first": pipe.has_first_stage}
    out["last"] = pipe.has_last_stage
    if pcfg.ep > 1:
        out["all_to_all"] = led.counts(group=mesh.get_group("ep")).get("all_to_all", 0)
        out["ep_all_gather"] = led.counts(group=mesh.get_group("ep")).get("all_gather", 0)
    if pcfg.tp > 1:
        out["tp_all_reduce"] = led.counts(group=mesh.get_group("tp")).get("all_reduce", 0)
    return out


def test_two_all_to_alls_each_way_per_moe_layer_and_microbatch(world):
    """EP: 2 all-to-alls forward (tokens out, outputs back) + 2 backward per MoE layer and microbatch, and one
    all-gather of the E per-expert counts that sizes them; nothing else on the EP group."""
    for r in world(4).run(_alltoall_case, dict(pp=2, microbatches=2, **EP)):
        calls = r["layers"] * r["microbatches"]
        assert (r["all_to_all"], r["ep_all_gather"]) == (4 * calls, calls), r


def test_tp_experts_one_all_reduce_each_way_per_moe_layer_and_microbatch(world):
    """TP of experts at Megatron's minimum (1 forward + 1 backward per MoE layer and microbatch), beside the
    attention's 1 + 1 (tiny Mixtral: no shared experts) and the column-parallel head's 1 backward (its replicated
    input's gradient) per microbatch; the untied embedding stays replicated (the default), so it adds none."""
    for r in world(4).run(_alltoall_case, dict(pp=2, microbatches=2, tp=2)):
        calls, head = r["layers"] * r["microbatches"], r["microbatches"] * r["last"]
        assert r["tp_all_reduce"] == 2 * calls + 2 * calls + head, r


# --- refusals, one line each, before any collective -------------------------------------------------------


def _preflight(model: torch.nn.Module, **kw) -> None:
    pcfg = pp_tp.config.resolve_parallel(ParallelConfig(**{"dp_shard": 1, **kw}), kw.get("world"))
    preflight(model, pcfg, PreflightInputs("cpu", SEQ))


@pytest.mark.parametrize(
    ("name", "kw", "match"),
    [
        (
            "mixtral_moe",
            dict(pp=2, microbatches=2, dp_shard=2, ep=3),
            r"parallel.ep = 3 does not divide parallel.dp_shard = 2",
        ),
        ("qwen3_moe", dict(dp_shard=8, ep=8), r"mlp.experts holds 4 experts, not divisible by parallel.ep = 8"),
        ("llama", dict(dp_shard=2, ep=2), r"parallel.ep = 2 but model LlamaForCausalLM has no experts modules"),
        (
            "qwen3_moe_odd_width",
            dict(pp=2, microbatches=2, tp=2),
            r"mlp.experts.down_proj: expert hidden size 17 is not divisible by parallel.tp = 2",
        ),
    ],
)
def test_bad_expert_layouts_are_refused_in_one_line(name, kw, match):
    with pytest.raises(ConfigError, match=match) as e:
        _preflight(make(name, "meta"), **kw)
    assert "\n" not in str(e.value)


def test_ep_rule_is_the_same_for_check_and_mesh():
    """`pp-tp check` (resolve_parallel) and build_mesh's shape refuse the same EP degree with the same line."""
    from pp_tp.parallel.mesh import mesh_shape

    pcfg = ParallelConfig(pp=2, dp_shard=-1, ep=4)
    with pytest.raises(ConfigError) as check:
        pp_tp.config.resolve_parallel(pcfg, 4)
    with pytest.raises(ConfigError) as mesh:
        mesh_shape(pcfg, 4)
    assert str(check.value) == str(mesh.value)
    assert not dist.is_initialized()
