"""The planner runs the runtime's build: `plan_job` refuses what `build_pipeline` refuses with the same line,
builds each distinct stage once through `preflight` + `build_local_stages` on meta, and its peaks for the shipped
multi-node configs are what they were before it did (issue 33, item 3).

build_pipeline runs in one process on torch's fake backend: its refusals come before any collective, and the one
exchange of `agreed` hands back this rank's outcome for every rank there.
"""

from __future__ import annotations

import os

import pytest
from train_utils import REPO

import pp_tp
from pp_tp.config import load_config
from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.models.factory import build_model
from pp_tp.parallel.mesh import make_mesh
from pp_tp.planner import plan_job, stage_build
from pp_tp.planner.fake_world import fake_world
from pp_tp.planner.moe import block_signatures, stage_kind

# (config, overrides, world size): refused by the model's rules (preflight), not by the config's alone.
REFUSED = {
    "more stages than layers": ("debug_cpu", ["parallel.pp=4", "parallel.tp=1", "model.n_layers=3"], 4),
    "tp not dividing heads": ("debug_cpu", ["parallel.tp=4", "model.n_heads=2", "model.dim=64"], 8),
    "ep not dividing experts": ("moe_cpu", ["model.n_experts=3", "model.top_k=1"], 4),
}

# The largest per-rank peak `plan_job` predicts for each shipped multi-node config at its own world size, in bytes,
# measured on the planner's own build path before it went through preflight + build_local_stages (main 44709c6).
PEAKS_BEFORE = {
    "llama3_8b": (8, 65_609_793_536),
    "llama3_70b": (32, 73_129_000_960),
    "llama3_405b": (1024, 78_209_286_144),
    "qwen3_235b_a22b": (256, 52_383_960_640),
    "deepseek_v3_671b": (1024, 53_016_690_704),
}


def _config(name: str, overrides: list[str], world: int):
    return load_config(os.path.join(REPO, "toml_configs", f"{name}.toml"), overrides, world)


def _runtime_refusal(name: str, overrides: list[str], world: int) -> str:
    cfg = _config(name, overrides, world)
    with fake_world(world), pytest.raises(ConfigError) as info:
        mesh = make_mesh("cpu", cfg.parallel, world)
        pp_tp.build_pipeline(build_model(cfg.model, "meta"), mesh, cfg.parallel, seq_len=cfg.training.seq_len)
    return str(info.value)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_plan_and_runtime_refuse_a_bad_layout_with_the_same_line(case):
    name, overrides, world = REFUSED[case]
    with pytest.raises(ConfigError) as planned:
        plan_job(_config(name, overrides, world), world)
    assert str(planned.value) == _runtime_refusal(name, overrides, world)


def test_each_distinct_stage_is_built_once_on_meta_through_the_runtime_path(monkeypatch):
    """preflight once, then build_local_stages once per stage kind, on the meta device, never materialized."""
    calls: dict[str, list] = {"preflight": [], "build": [], "materialize": []}
    real_preflight, real_build = stage_build.preflight, stage_build.build_local_stages

    def spy_preflight(*args, **kwargs):
        calls["preflight"].append(args)
        return real_preflight(*args, **kwargs)

    def spy_build(model, layout, plan, pp_rank, mesh, pcfg, fsdp, device, *rest):
        calls["build"].append((plan.stages[0].index, pp_rank, device.type))
        return real_build(model, layout, plan, pp_rank, mesh, pcfg, fsdp, device, *rest)

    monkeypatch.setattr(stage_build, "preflight", spy_preflight)
    monkeypatch.setattr(stage_build, "build_local_stages", spy_build)
    monkeypatch.setattr("pp_tp.materialize.local_stages.materialize", lambda *a, **k: calls["materialize"].append(a))
    cfg = _config("debug_cpu", ["parallel.pp=4", "parallel.tp=1", "model.n_layers=8"], 4)
    job = plan_job(cfg, 4)
    model = build_model(job.cfg.model, "meta")
    signatures = block_signatures(model, layout_for(model))
    kinds = {stage_kind(s, signatures): s for s in reversed(job.plan.stages)}  # the first stage of each kind
    assert len(calls["preflight"]) == 1 and not calls["materialize"]
    assert sorted(calls["build"]) == sorted((s.index, s.rank, "meta") for s in kinds.values())
    assert len(calls["build"]) == 3 < len(job.plan.stages)  # embed, middle, head: the two middle stages alike


@pytest.mark.parametrize("name", sorted(PEAKS_BEFORE))
def test_shipped_multi_node_peaks_are_unchanged(name):
    world, before = PEAKS_BEFORE[name]
    job = plan_job(_config(name, [], world), world)
    assert job.peak_bytes == pytest.approx(before, rel=0.01)
