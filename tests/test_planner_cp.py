"""The planner under context parallel (`parallel.cp`): the stage forward measured as a cp rank runs it (seq / cp tokens,
the K/V all-gather on the fake process group), FSDP over dp_shard x cp, the K/V bytes, and `--search` over cp.

Single process: the dry run needs no peers. tests/test_context_parallel.py checks kv_gather_bytes against a real
run's collective ledger; bench/activation_memory.py --cp checks the activation peaks against a real run's.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from pp_tp.config import config_from_dict, load_config
from pp_tp.layout import layout_for
from pp_tp.models.factory import build_model
from pp_tp.planner import format_plan, plan_job, search
from pp_tp.planner.context import kv_gather_bytes, rank_kv_bytes
from pp_tp.planner.layout_eval import LayoutEvaluator
from pp_tp.planner.search import DEVICES, Device, _layouts, step_time

SEQ, DIM, M = 128, 128, 2
JOB = {
    "model": {"vocab_size": 512, "dim": DIM, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 384,
              "max_seq_len": SEQ},
    "parallel": {"pp": 2, "dp_shard": 1, "schedule": "1F1B", "microbatches": M, "mixed_precision": "fp32"},
    "training": {"batch_size": 4, "seq_len": SEQ},
}  # fmt: skip


def _job(cp: int, **parallel):
    job = dict(JOB, parallel={**JOB["parallel"], "cp": cp, **parallel})
    world = 2 * cp * parallel.get("dp_shard", 1)
    return config_from_dict(job, world_size=world), world


@pytest.fixture(scope="module")
def plans():
    return {cp: plan_job(*_job(cp)) for cp in (1, 2, 4)}


def test_activations_per_rank_shrink_with_cp_within_the_issues_bar(plans):
    """seq / cp tokens per rank, plus the whole sequence's K and V attention saves (no mask): just over 1/cp."""
    for cp, bar in ((2, 0.55), (4, 0.30)):
        for r1, r in zip(plans[1].ranks, plans[cp].ranks):
            ratio = sum(r.act_bytes_per_microbatch.values()) / sum(r1.act_bytes_per_microbatch.values())
            assert 1 / cp < ratio <= bar, (cp, r.pp_rank, ratio)


def test_fsdp_shards_over_cp_and_buffers_hold_local_tokens(plans):
    """cp ranks hold the same parameters, FSDP-sharded over them; receive buffers are [mb, seq / cp, dim], and no
    stage keeps a mask across steps (causal layers run by blocks with none; pp_tp/parallel/cp_attention_blocks.py)."""
    mb = JOB["training"]["batch_size"] // M
    for cp in (2, 4):
        for r1, r in zip(plans[1].ranks, plans[cp].ranks):
            assert r.local_params == pytest.approx(r1.local_params / cp, rel=0.01)
            boundary = M * mb * (SEQ // cp) * DIM * 4  # one boundary per stage (pp2), fp32
            assert r.buffer_bytes == boundary, (cp, r.pp_rank)


def test_kv_bytes_and_the_report(plans):
    """Per attention layer and microbatch: K and V of [mb, kv_heads, seq, head_dim]; per rank and step forward and
    backward, (cp - 1) / cp of it, for each of its layers and microbatches."""
    job = plans[2]
    p, mb = job.cfg.parallel, job.microbatch
    one = kv_gather_bytes(mb, SEQ, job.dims, p)
    assert one == 2 * mb * 2 * SEQ * (DIM // 4) * 4
    assert rank_kv_bytes(2, p, mb, SEQ, job.dims) == 2 * 2 * M * one / 2
    text = format_plan(job)
    assert f"context parallel: cp=2, {SEQ // 2} of {SEQ} tokens" in text and "FSDP over dp_shard x cp = 2" in text
    assert job.mesh["cp"] == 2


def test_cached_evaluation_equals_the_full_dry_run_under_cp():
    """The search's per-kind stage costs (a fake world of cp x tp ranks) equal the dry run's, FSDP over
    dp_shard x cp included."""
    cfg, world = _job(2, dp_shard=2)
    model = build_model(cfg.model, "meta")
    evaluator = LayoutEvaluator(cfg, world, model, layout_for(model))
    pcfg = dataclasses.replace(cfg.parallel, split="balanced", memory_budget_gib=1.0,
                               fsdp_reshard_after_forward="auto", fsdp_grad_reduce="auto")  # fmt: skip
    lay = evaluator.evaluate(pcfg)
    job = plan_job(dataclasses.replace(cfg, parallel=pcfg), world)
    assert [r.total_bytes for r in lay.ranks] == [r.total_bytes for r in job.ranks]
    assert [r.local_params for r in lay.ranks] == [r.local_params for r in job.ranks]
    assert [r.buffer_bytes for r in lay.ranks] == [r.buffer_bytes for r in job.ranks]


def test_search_tries_cp_and_charges_its_all_gathers(monkeypatch):
    """cp is searched where 2 x cp divides seq_len; a cp layout's step pays its K/V bytes at NVLink bandwidth (the
    cp x tp group fits a node), not overlapped, stretched by the bubble like compute."""
    cfg, _ = _job(1)
    short = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, seq_len=24))
    assert {kw["cp"] for kw in _layouts(short, 8)} == {1, 2, 4}  # 2 x 8 does not divide 24
    cfg, world = _job(2)
    model = build_model(cfg.model, "meta")
    evaluator = LayoutEvaluator(cfg, world, model, layout_for(model))
    lay = evaluator.evaluate(dataclasses.replace(cfg.parallel, split="balanced", memory_budget_gib=1.0))
    dev, dims = Device(*DEVICES["H100"]), evaluator.costs.dims
    with_kv = step_time(cfg, lay, dev, dims)
    monkeypatch.setattr(search, "rank_kv_bytes", lambda *a: 0.0)
    sent = rank_kv_bytes(2, lay.pcfg, lay.microbatch, SEQ, dims)  # two layers on each pp rank
    assert sent == 2 * 2 * M * kv_gather_bytes(lay.microbatch, SEQ, dims, lay.pcfg) / 2
    assert with_kv - step_time(cfg, lay, dev, dims) == pytest.approx(sent / dev.nvlink_bw * (1 + lay.bubble))


def test_long_context_config_plans_without_masks():
    """Llama 3 8B at 131072 tokens (pp2 x tp8 x cp32): causal layers save no [S/cp, S] mask and cache none, so pp
    rank 0 peaks at about 17 GiB; SDPA's float mask, 1 GiB per layer, made it 49.85 GiB before issue 47."""
    path = os.path.join(os.path.dirname(__file__), "..", "toml_configs", "llama3_8b_128k.toml")
    job = plan_job(load_config(path, world_size=512), 512)
    assert job.peak_bytes / 2**30 <= 28 and all(r.buffer_bytes == 8 * 4096 * 4096 * 2 for r in job.ranks)
