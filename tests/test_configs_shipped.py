"""Every shipped TOML loads and validates at the world size it is written for, and has the shape it claims."""

from __future__ import annotations

import glob
import importlib.util
import os
import re

import pytest
from train_utils import REPO

from pp_tp.cli.job import check_job
from pp_tp.config import load_config
from pp_tp.layout import layout_for
from pp_tp.models.factory import build_model
from pp_tp.split.plan import plan_stages

# name: (world size, resolved (pp, tp, dp_replicate, dp_shard), stages per rank, (microbatches, sequences in each),
#        parameters in billions, layers per stage)
SHIPPED = {
    "debug_cpu": (4, (2, 2, 1, 1), 1, (4, 4), 0.0002177, [2, 2]),
    "hf_tiny_cpu": (4, (2, 1, 1, 2), 1, (4, 2), 0.0008695, [2, 2]),
    "moe_cpu": (4, (2, 1, 1, 2), 1, (4, 2), 0.000526912, [2, 2]),
    "credit_cpu": (4, (2, 2, 1, 1), 1, (4, 4), 0.00013946, [2, 2]),
    "vit_cpu": (4, (2, 2, 1, 1), 1, (4, 8), 0.00013857, [2, 2]),
    "corpus_cpu": (4, (2, 1, 1, 2), 1, (4, 2), 0.0008695, [2, 2]),
    "llama3_8b": (8, (2, 2, 1, 2), 1, (8, 1), 8.03, [16, 16]),
    "llama3_8b_128k": (512, (2, 8, 1, 1), 1, (8, 1), 8.03, [16, 16]),  # cp32 beside these
    "long_context_cpu": (4, (2, 1, 1, 1), 1, (2, 1), 0.0002177, [2, 2]),  # cp2 beside these
    "llama3_70b": (32, (4, 8, 1, 1), 2, (16, 1), 70.55, [10] * 8),
    "llama3_405b": (1024, (8, 8, 1, 16), 1, (32, 1), 405.85, [15] + [16] * 6 + [15]),
    "qwen3_235b_a22b": (256, (8, 1, 1, 32), 1, (32, 1), 235.09, [12] * 6 + [13, 9]),
    "deepseek_v3_671b": (1024, (16, 1, 1, 64), 2, (64, 1), 671.03, [1] + [2] * 30 + [0]),  # DualPipeV: 32 stages
}


def test_every_shipped_config_is_covered():
    names = {os.path.basename(p)[:-5] for p in glob.glob(os.path.join(REPO, "toml_configs", "*.toml"))}
    assert names == set(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_config_validates_at_its_world_size(name, monkeypatch):
    world, degrees, stages_per_rank, microbatches, billions, layers = SHIPPED[name]
    monkeypatch.chdir(REPO)  # data.path in debug_cpu.toml is relative to the repository root
    cfg = load_config(os.path.join("toml_configs", f"{name}.toml"), world_size=world)
    check_job(cfg)
    p = cfg.parallel
    assert (p.pp, p.tp, p.dp_replicate, p.dp_shard) == degrees  # dp_shard = -1 resolved to the rest of the world
    assert p.stages_per_rank == stages_per_rank
    assert (p.microbatches, cfg.training.batch_size // (p.dp * p.microbatches)) == microbatches
    model = build_model(cfg.model)  # on the meta device
    assert sum(x.numel() for x in model.parameters()) / 1e9 == pytest.approx(billions, rel=1e-3)
    plan = plan_stages(model, layout_for(model), p, cfg.training.seq_len)
    assert [len(s.blocks) for s in plan.stages] == layers


def test_a_shipped_config_refuses_the_wrong_world_size():
    from pp_tp.errors import ConfigError

    with pytest.raises(ConfigError, match="parallel.dp_shard = 2"):
        load_config(os.path.join(REPO, "toml_configs", "llama3_8b.toml"), world_size=16)


@pytest.mark.parametrize(
    "name", ["llama3_8b", "llama3_8b_128k", "llama3_70b", "llama3_405b", "qwen3_235b_a22b", "deepseek_v3_671b"]
)
def test_multi_node_configs_fit_80_gb_per_the_planner(name):
    """The planner's largest per-rank peak at the config's own world size, "auto" policies resolved."""
    from pp_tp.planner import plan_job

    world = SHIPPED[name][0]
    job = plan_job(load_config(os.path.join(REPO, "toml_configs", f"{name}.toml"), world_size=world), world)
    budget = job.cfg.parallel.memory_budget_gib or 76
    assert job.peak_bytes / 2**30 <= budget <= 80
    assert "auto" not in (job.policies.fsdp_reshard_after_forward, job.policies.fsdp_grad_reduce)


def test_every_documented_module_entry_runs_as_a_script():
    """`python -m pp_tp.X` / `torchrun ... -m pp_tp.X` in the docs and the shipped TOMLs name a module that exists
    and runs its entry when started as a script (the multi-node docs move with the tree)."""
    docs = glob.glob(os.path.join(REPO, "docs", "*.md")) + glob.glob(os.path.join(REPO, "toml_configs", "*.toml"))
    docs.append(os.path.join(REPO, "README.md"))
    modules = {m for path in docs for m in re.findall(r"-m (pp_tp[\w.]*)", open(path).read())}
    assert "pp_tp.cli.train" in modules
    for name in sorted(modules):
        spec = importlib.util.find_spec(name)
        assert spec is not None, name
        if spec.submodule_search_locations:  # a package runs its __main__.py
            assert os.path.isfile(os.path.join(os.path.dirname(spec.origin), "__main__.py")), name
        else:
            assert 'if __name__ == "__main__":' in open(spec.origin).read(), name
