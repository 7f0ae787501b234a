"""`pp-tp plan --search`: the cached layout evaluation equals the full dry run, and the search's output."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from pp_tp.cli.main import main
from pp_tp.config import config_from_dict
from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.models.factory import build_model
from pp_tp.planner import plan_job
from pp_tp.planner.layout_eval import LayoutEvaluator
from pp_tp.planner.search import _layouts

JOB = {
    "model": {"vocab_size": 256, "dim": 64, "n_layers": 8, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96},
    "parallel": {"pp": 2, "tp": 2, "dp_shard": -1, "schedule": "1F1B", "microbatches": 4, "mixed_precision": "bf16"},
    "training": {"batch_size": 48, "seq_len": 32},
}
WORLD = 12  # dp 3 at pp2 x tp2: FSDP shards that do not divide evenly (padding)

LAYOUTS = [
    dict(pp=2, tp=2, dp_shard=3, schedule="1F1B", stages_per_rank=1, microbatches=4, activation_checkpoint="none"),
    dict(pp=2, tp=1, dp_shard=6, schedule="GPipe", stages_per_rank=1, microbatches=8, activation_checkpoint="full"),
    dict(pp=4, tp=1, dp_shard=3, schedule="Interleaved1F1B", stages_per_rank=2, microbatches=4,
         activation_checkpoint="selective"),
    dict(pp=2, tp=2, dp_shard=3, schedule="ZBVZeroBubble", stages_per_rank=2, microbatches=4,
         activation_checkpoint="full"),
]  # fmt: skip


def _auto(cfg, kw: dict, budget_gib: float):
    return dataclasses.replace(
        cfg.parallel, **kw, split="balanced", fsdp_reshard_after_forward="auto", fsdp_grad_reduce="auto",
        memory_budget_gib=budget_gib,
    )  # fmt: skip


@pytest.mark.parametrize("kw", LAYOUTS, ids=[f"{k['schedule']}-pp{k['pp']}" for k in LAYOUTS])
def test_cached_evaluation_equals_the_full_dry_run(kw):
    """Generous budget (torch's policies), then 1 % under that peak (auto moves the peak rank off them)."""
    cfg = config_from_dict(JOB, world_size=WORLD)
    model = build_model(cfg.model, "meta")
    evaluator = LayoutEvaluator(cfg, WORLD, model, layout_for(model))
    budget = 1.0
    for _ in range(2):
        pcfg = _auto(cfg, kw, budget)
        lay = evaluator.evaluate(pcfg)
        if lay is None:  # nothing fits: the dry run refuses the same budget
            with pytest.raises(ConfigError, match="no FSDP policy fits"):
                plan_job(dataclasses.replace(cfg, parallel=pcfg), WORLD)
            return
        job = plan_job(dataclasses.replace(cfg, parallel=pcfg), WORLD)
        assert lay.pcfg.fsdp_grad_reduce == job.policies.fsdp_grad_reduce
        assert lay.pcfg.fsdp_reshard_after_forward == job.policies.fsdp_reshard_after_forward
        assert [r.total_bytes for r in lay.ranks] == [r.total_bytes for r in job.ranks]
        assert [r.local_params for r in lay.ranks] == [r.local_params for r in job.ranks]
        assert lay.bubble == job.schedules[0].bubble_simulated
        budget = 0.99 * lay.peak_bytes / 2**30
    assert (lay.pcfg.fsdp_reshard_after_forward, lay.pcfg.fsdp_grad_reduce) != ("default", "step")


def test_search_covers_the_schedules_policies_and_ac():
    cfg = config_from_dict(JOB, world_size=WORLD)
    seen = {(kw["schedule"], kw["stages_per_rank"]) for kw in _layouts(cfg, WORLD)}
    assert {("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)} <= seen
    assert {kw["activation_checkpoint"] for kw in _layouts(cfg, WORLD)} == {"none", "selective", "full"}


def test_search_json_lists_fitting_layouts_fastest_first(tmp_path, capsys):
    path = tmp_path / "job.toml"
    from pp_tp.config import format_config

    path.write_text(format_config(config_from_dict(JOB, world_size=WORLD)))
    argv = ["plan", "--config", str(path), "--world-size", str(WORLD), "--search", "--json", "--top", "50"]
    assert main([*argv, "--memory-gib", "0.003"]) == 0
    out = json.loads(capsys.readouterr().out)
    cands = out["candidates"]
    assert len(cands) > 5 and out["peak_gib"] > 0
    assert [c["step_time_s"] for c in cands] == sorted(c["step_time_s"] for c in cands)
    assert all(c["peak_gib"] <= 0.003 for c in cands)
    keys = {"pp", "tp", "dp_shard", "schedule", "microbatches", "fsdp_reshard_after_forward", "fsdp_grad_reduce"}
    assert keys <= set(cands[0]["parallel"])


# The reference MoE with dense and MoE layers alternating (blocks of two signatures): 8 ranks, pp2 x dp_shard4 x
# ep2 leaves the experts FSDP-sharded over 2 ranks.
MOE_JOB = {
    "model": {"vocab_size": 256, "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96,
              "n_experts": 4, "top_k": 2, "moe_ffn_dim": 32, "n_shared_experts": 1, "moe_every": 2},
    "parallel": {"pp": 2, "dp_shard": 4, "ep": 2, "schedule": "1F1B", "microbatches": 2, "mixed_precision": "bf16"},
    "training": {"batch_size": 16, "seq_len": 32},
}  # fmt: skip


def test_moe_layouts_search_ep_and_evaluate_like_the_full_dry_run():
    """ep is searched (divisors of dp_shard splitting the experts), and an ep layout's cached evaluation (experts
    FSDP over dp_shard / ep, dense and MoE blocks measured apart) equals the full dry run."""
    from pp_tp.planner.moe import all_to_all_bytes, model_experts
    from pp_tp.planner.search import DEVICES, Device, step_time

    cfg = config_from_dict(MOE_JOB, world_size=8)
    model = build_model(cfg.model, "meta")
    experts = model_experts(model, layout_for(model))
    assert (experts.n_experts, experts.top_k, sorted(experts.moe_blocks)) == (4, 2, ["1", "3"])
    eps = {(kw["dp_shard"], kw["ep"]) for kw in _layouts(cfg, 8, experts)}
    assert {(4, 1), (4, 2), (4, 4), (8, 4), (2, 2)} <= eps and (8, 8) not in eps  # 4 experts: ep 8 cannot split
    evaluator = LayoutEvaluator(cfg, 8, model, layout_for(model))
    kw = dict(pp=2, tp=1, ep=2, dp_shard=4, schedule="1F1B", stages_per_rank=1, microbatches=2,
              activation_checkpoint="none")  # fmt: skip
    pcfg = _auto(cfg, kw, 1.0)
    lay = evaluator.evaluate(pcfg)
    job = plan_job(dataclasses.replace(cfg, parallel=pcfg), 8)
    assert [r.total_bytes for r in lay.ranks] == [r.total_bytes for r in job.ranks]
    assert [r.local_params for r in lay.ranks] == [r.local_params for r in job.ranks]
    # The all-to-all: 4 x tokens x top_k x dim x 2 bytes x (ep - 1) / ep per MoE layer and microbatch, one MoE
    # layer per pp rank, 2 microbatches of 2 x 32 tokens; on NVLink (ep x tp = 2 fits a node).
    assert all_to_all_bytes(64, experts, 64, 2, 2) == 4 * 64 * 2 * 64 * 2 / 2
    dev, dims = Device(*DEVICES["H100"]), evaluator.costs.dims
    extra = step_time(cfg, lay, dev, dims, experts) - step_time(cfg, lay, dev, dims)
    assert extra == pytest.approx(2 * 32768 / dev.nvlink_bw * (1 + lay.bubble), rel=1e-6)


def test_search_stops_at_the_step_time_floor_and_measures_less(monkeypatch):
    """The branch and bound builds fewer probe stages than the exhaustive search (counted where the cache calls
    pp_tp.planner.stage_build.build_stage, not timed), and its floor is below each layout's step time."""
    import pp_tp.planner.stage_costs as stage_costs
    from pp_tp.planner.search import DEVICES, Device, search, step_time, time_floor

    builds = []
    build = stage_costs.build_stage
    monkeypatch.setattr(stage_costs, "build_stage", lambda *a, **k: builds.append(1) or build(*a, **k))
    cfg = config_from_dict(JOB, world_size=WORLD)
    dev = Device(*DEVICES["H100"])
    best = search(cfg, WORLD, 0.002, dev, 3)
    assert len(best) == 3 and len(builds) <= 15  # the exhaustive search (f099c18) built 63 probe stages here
    assert [c.step_time_s for c in best] == sorted(c.step_time_s for c in best)
    model = build_model(cfg.model, "meta")
    evaluator = LayoutEvaluator(cfg, WORLD, model, layout_for(model))
    for kw in LAYOUTS:
        outline = evaluator.outline(_auto(cfg, kw, 1.0))
        lay = evaluator.fit(outline)
        assert 0 < time_floor(cfg, outline, dev, evaluator.costs.dims) <= step_time(cfg, lay, dev, evaluator.costs.dims)


@pytest.mark.parametrize("name", ["tied-pp1", "hf-pp2"])
def test_stage_edges_measured_apart_add_up_as_the_dry_run_measures_them_together(name):
    """The cache measures a stage's embedding and head apart from its blocks and adds them (the assumption stated in
    pp_tp.planner.stage_costs): on a one-stage plan with tied embeddings (one weight in both edges) and on an HF
    family (its own prologue on the first stage), the sums equal the full dry run, which builds the stages whole."""
    if name == "tied-pp1":
        d = {**JOB, "model": {**JOB["model"], "tie_embeddings": True}}
        kw = dict(pp=1, tp=2, dp_shard=6, schedule="1F1B", stages_per_rank=1, microbatches=4,
                  activation_checkpoint="full")  # fmt: skip
    else:
        d = {**JOB, "model": {"hf_path": "toml_configs/hf_tiny"}, "training": {"batch_size": 8, "seq_len": 32}}
        kw = dict(pp=2, tp=1, dp_shard=2, schedule="1F1B", stages_per_rank=1, microbatches=2,
                  activation_checkpoint="selective")  # fmt: skip
    world = 12 if name == "tied-pp1" else 4
    cfg = config_from_dict(d, world_size=world)
    model = build_model(cfg.model, "meta")
    pcfg = _auto(cfg, kw, 100.0)
    lay = LayoutEvaluator(cfg, world, model, layout_for(model)).evaluate(pcfg)
    job = plan_job(dataclasses.replace(cfg, parallel=pcfg), world)
    assert [r.total_bytes for r in lay.ranks] == [r.total_bytes for r in job.ranks]
    assert [r.local_params for r in lay.ranks] == [r.local_params for r in job.ranks]
    assert [r.act_bytes_per_microbatch for r in lay.ranks] == [r.act_bytes_per_microbatch for r in job.ranks]


@pytest.mark.parametrize("name", ["dense", "moe", "hf"])
def test_cost_floor_is_below_the_none_and_selective_costs(name):
    """The search leaves a layout under AC "none" or "selective" unmeasured when no policy fits one of its pp ranks
    even at the cost floor (StageCostCache.floor, read off the "full" AC measurement). The floor's stated
    assumption, field by field, on stage kinds with and without edges, one and three blocks (dense and MoE mixed),
    with tp, cp and ep, at microbatches of one and two sequences and of four (extrapolated); parameters, buffers and
    masks equal. It counts the saves of every block of the first block's kind: at least 80 % of the measured
    activations of a stage of such blocks."""
    from pp_tp.planner.moe import block_signatures
    from pp_tp.planner.stage_costs import StageCostCache

    d, world = {"dense": (JOB, WORLD), "moe": (MOE_JOB, 8)}.get(name, (None, 4))
    if name == "hf":
        d = {**JOB, "model": {"hf_path": "toml_configs/hf_tiny"}, "training": {"batch_size": 8, "seq_len": 32}}
    cfg = config_from_dict(d, world_size=world)
    model = build_model(cfg.model, "meta")
    layout = layout_for(model)
    cache = StageCostCache(cfg, model, layout)
    sigs = list(dict.fromkeys(block_signatures(model, layout).values()))
    blocks = [(sigs[0],), (sigs[0],) * 3] + ([tuple(sigs[:3])] if len(sigs) > 1 else [])
    kinds = [(e, b, h) for e in (False, True) for h in (False, True) for b in blocks] + [(True, (), True)]
    points = [(1, 1, 1), (2, 1, 2)] + ([(1, 2, 1)] if name == "moe" else [])  # (tp, ep, cp)
    same = ("local", "tp_local", "unit_tp_local", "buffer_bytes", "held_bytes")
    ratios = []
    for (tp, ep, cp), kind, mb, ac in itertools.product(points, kinds, (1, 2, 4), ("none", "selective")):
        floor, cost = cache.floor(tp, ac, ep, cp, kind, 2, mb), cache.cost(tp, ac, ep, cp, kind, 2, mb)
        assert all(getattr(floor, k) == getattr(cost, k) for k in same), (tp, ep, cp, kind, mb, ac)
        assert floor.act_bytes <= cost.act_bytes and floor.transient_bytes <= cost.transient_bytes
        if set(kind[1]) <= {sigs[0]}:  # blocks of another kind count nothing in the floor
            ratios.append(floor.act_bytes / cost.act_bytes)
    assert len(ratios) == len(points) * (len(kinds) - 4 * (len(sigs) > 1)) * 6 and min(ratios) >= 0.8, min(ratios)


def test_walk_cache_is_shared_only_by_layouts_that_walk_alike():
    """LayoutEvaluator._walked keys a rank's walks by schedule, pp rank and stage sizes (DP-gathered): a layout that
    differs only in dp_replicate x dp_shard reads the first one's walks, and every walk the search settles a rank
    with equals that rank's own walk_step (also for a layout of other sizes, which must not share them)."""
    from pp_tp.planner.walk import walk_step

    cfg = config_from_dict(JOB, world_size=WORLD)
    model = build_model(cfg.model, "meta")
    evaluator = LayoutEvaluator(cfg, WORLD, model, layout_for(model))
    base = dict(pp=2, tp=1, schedule="1F1B", stages_per_rank=1, microbatches=4, activation_checkpoint="full")
    keys = []
    for kw in ({"dp_shard": 6}, {"dp_replicate": 2, "dp_shard": 3}, {"tp": 2, "dp_shard": 3}):
        lay = evaluator.evaluate(_auto(cfg, {**base, **kw}, 1.0))
        actions = evaluator.outline(lay.pcfg).actions
        for rank, walk in zip(lay.ranks, lay.walks):
            assert walk == walk_step(actions[rank.pp_rank], rank.sizes, rank.policy, lay.pcfg.microbatches)
        keys.append(set(evaluator._walks))
    assert keys[0] == keys[1] and len(keys[0]) == 2  # dp_replicate x dp_shard: the same two ranks' walks reused
    assert len(keys[2] - keys[1]) == 2  # other stage sizes (tp 2): walked anew


@pytest.mark.parametrize("name", ["dense", "moe", "hf"])
def test_a_lone_first_block_read_off_its_pair_equals_its_own_measurement(name):
    """StageCostCache measures a stage of its first block alone inside the (first block, further block) pair, at the
    first block's end (activations.Saved.first_block): every field equals building and running it alone."""
    from pp_tp.planner.stage_costs import StageCostCache

    d, world, point = {"dense": (JOB, WORLD, (2, "full", 1, 2)), "moe": (MOE_JOB, 8, (1, "none", 2, 1))}.get(
        name, (None, 4, (1, "selective", 1, 2))
    )  # point: (tp, AC, ep, cp)
    if name == "hf":
        d = {**JOB, "model": {"hf_path": "toml_configs/hf_tiny"}, "training": {"batch_size": 8, "seq_len": 32}}
    cfg = config_from_dict(d, world_size=world)
    model = build_model(cfg.model, "meta")
    apart, together = (StageCostCache(cfg, model, layout_for(model)) for _ in range(2))
    first = apart._first
    other = next(k for keys in apart._keys.values() for k in keys if k != first)
    single, pair = (False, (first,), False), (False, (first, other), False)
    apart._measure(*point, [single])
    together._measure(*point, [pair, single])
    assert apart._measured[(*point, single)] == together._measured[(*point, single)]
    assert apart._measured[(*point, single)].act > 0


@pytest.mark.parametrize("name", ["dense", "moe", "hf"])
def test_edges_at_a_larger_cp_follow_from_cp_2_as_measured(name):
    """StageCostCache measures an edge stage (embedding and/or head and loss, no block) at cp 1 and 2 only and takes
    larger cp degrees from cp 2 (the assumption stated in pp_tp.planner.stage_costs: a constant plus what grows with
    a cp rank's tokens): every field equals building and running the edge stage at that cp."""
    from pp_tp.planner.stage_costs import StageCostCache

    d, world = {"dense": (JOB, WORLD), "moe": (MOE_JOB, 8)}.get(name, (None, 4))
    if name == "hf":
        d = {**JOB, "model": {"hf_path": "toml_configs/hf_tiny"}, "training": {"batch_size": 8, "seq_len": 32}}
    cfg = config_from_dict(d, world_size=world)
    model = build_model(cfg.model, "meta")
    scaled, measured = (StageCostCache(cfg, model, layout_for(model)) for _ in range(2))
    constants = []
    for tp, ac, cp, edges in itertools.product((1, 2), ("none", "full"), (4, 8), [(True, (), True), (True, (), False)]):
        edges = (edges[0], (), edges[2] if tp == 1 else not edges[2])  # tp 2: the embedding alone, the head alone
        assert scaled._scaled(tp, ac, 1, cp, edges), (tp, ac, cp, edges)
        measured._measure(tp, ac, 1, cp, [edges])
        key = (tp, ac, 1, cp, edges)
        assert scaled._measured[key] == measured._measured[key], key
        constants.append(2 * scaled._measured[key].act - scaled._measured[key].act2)
    assert min(constants) >= 0 and max(constants) > 0  # the loss's scalars: not in proportion to the tokens


@pytest.mark.parametrize("name", ["dense", "moe", "hf"])
def test_under_full_ac_a_further_block_adds_what_the_first_keeps_of_its_own(name):
    """Under full AC StageCostCache takes what a further block of the first block's kind adds from the first block's
    own measurement (activations.Saved.block_input: what its checkpoint keeps that the stage did not hand it, its
    hidden state and FSDP's per-block casts of the rotary table) instead of measuring the pair (first, further):
    every field of the pair minus the first block alone equals it, at microbatches of one and two sequences."""
    from pp_tp.planner.stage_costs import StageCostCache

    d, world, points = {"dense": (JOB, WORLD, [(2, 1, 2), (1, 1, 1)]), "moe": (MOE_JOB, 8, [(1, 2, 1)])}.get(
        name, (None, 4, [(1, 1, 2)])
    )  # points: (tp, ep, cp)
    if name == "hf":
        d = {**JOB, "model": {"hf_path": "toml_configs/hf_tiny"}, "training": {"batch_size": 8, "seq_len": 32}}
    cfg = config_from_dict(d, world_size=world)
    model = build_model(cfg.model, "meta")
    cache = StageCostCache(cfg, model, layout_for(model))
    first = cache._first
    further = next(k for keys in cache._keys.values() if first in keys for k in keys if k != first)
    single, pair = (False, (first,), False), (False, (first, further), False)
    kind = (False, (next(sig for sig, keys in cache._keys.items() if first in keys),) * 3, False)
    assert cache._probes(kind, "full")[1] == [(single, single)] * 2  # no pair is measured for it
    for tp, ep, cp in points:
        cache._measure(tp, "full", ep, cp, [single])  # apart: the search measures it alone
        cache._measure(tp, "full", ep, cp, [pair])
        one, two = cache._measured[(tp, "full", ep, cp, single)], cache._measured[(tp, "full", ep, cp, pair)]
        assert (two.act - one.act, two.act2 - one.act2) == (one.block_input, one.block_input2), (tp, ep, cp)
        assert two.shapes == one.shapes + one.shapes and two.experts == one.experts + one.experts
        assert two.blocks == one.blocks * 2 and two.rest == one.rest


def test_the_config_rules_do_not_depend_on_the_ac_mode():
    """The search validates a layout once for its three AC modes (pp_tp.planner.search._search): on every layout it
    enumerates (the refused ones too, with the MoE job's ep axis), validating under each mode gives the same
    [parallel] but its AC, or the same refusal."""
    from pp_tp.planner.moe import model_experts

    for d, world in ((JOB, WORLD), (MOE_JOB, 8)):
        cfg = config_from_dict(d, world_size=world)
        model = build_model(cfg.model, "meta")
        evaluator = LayoutEvaluator(cfg, world, model, layout_for(model))
        seen = {}
        for kw in _layouts(cfg, world, model_experts(model, layout_for(model))):
            ac = kw.pop("activation_checkpoint")
            try:
                p = evaluator.outline(_auto(cfg, {**kw, "activation_checkpoint": ac}, 1.0)).pcfg
                verdict = dataclasses.replace(p, activation_checkpoint="none")
            except ConfigError as e:
                verdict = str(e)
            assert seen.setdefault(tuple(sorted(kw.items())), verdict) == verdict, (kw, ac)
        assert any(isinstance(v, str) for v in seen.values()) and len(seen) > 20
