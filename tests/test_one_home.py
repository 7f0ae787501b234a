"""One home per rule: every refusal `build_pipeline` raises on a job is the line `pp-tp check` prints for it.

build_pipeline runs here in one process on torch's fake backend (its refusals come before any collective,
so no peer is needed); `pp-tp check` runs through the CLI's own main().
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import pp_tp
from pp_tp.cli.main import main
from pp_tp.config import load_config
from pp_tp.errors import ConfigError
from pp_tp.models.factory import build_model
from pp_tp.parallel.mesh import MESH_DIMS, mesh_shape
from pp_tp.planner.fake_world import fake_world

CONFIG = os.path.join(os.path.dirname(__file__), "..", "toml_configs", "debug_cpu.toml")

# (overrides, world size): each is refused by the model's rules, not the config's alone.
REFUSED = [
    (["parallel.pp=1", "parallel.tp=2", "model.tie_embeddings=true", "parallel.embedding=replicate"], 2),
    (["model.tie_embeddings=true", "parallel.embedding=replicate"], 4),
    (["parallel.tp=4", "model.n_heads=2", "model.dim=64"], 8),
    (["model.ffn_dim=171"], 4),
    (["model.vocab_size=257"], 4),
    (["parallel.pp=4", "parallel.tp=1", "model.n_layers=3"], 4),
    (["parallel.split=layers_per_stage", "parallel.layers_per_stage=[1, 1]"], 4),
    (['parallel.split="explicit"', 'parallel.stage_fqns=[["tok_embeddings", "layers.0"], ["norm", "output"]]'], 4),
    (["training.seq_len=999"], 4),
    (["parallel.float8=true", "parallel.float8_fsdp_all_gather=true"], 4),
]


def _check_line(overrides: list[str], world: int, capsys) -> str:
    assert main(["check", "--config", CONFIG, "--world-size", str(world), *overrides]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0][len("error: ") :]


def _build_error(overrides: list[str], world: int) -> str:
    cfg = load_config(CONFIG, overrides, world)
    with fake_world(world), pytest.raises(ConfigError) as info:
        mesh = init_device_mesh("cpu", mesh_shape(cfg.parallel, world), mesh_dim_names=MESH_DIMS)
        pp_tp.build_pipeline(build_model(cfg.model, "meta"), mesh, cfg.parallel, seq_len=cfg.training.seq_len)
    return str(info.value)


@pytest.mark.parametrize("overrides, world", REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_check_refuses_what_build_pipeline_refuses_with_the_same_line(overrides, world, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert _check_line(overrides, world, capsys) == _build_error(overrides, world)


def test_v_schedules_default_to_two_stages_per_rank_in_python_toml_and_build():
    for schedule in ("DualPipeV", "ZBVZeroBubble"):
        pcfg = pp_tp.ParallelConfig(pp=2, schedule=schedule, microbatches=4, dp_shard=1, mixed_precision="fp32")
        with fake_world(2):
            mesh = init_device_mesh("cpu", mesh_shape(pcfg, 2), mesh_dim_names=MESH_DIMS)
            with torch.device("meta"):
                model = pp_tp.models.Transformer(pp_tp.models.ModelArgs(n_layers=4))
            pipe = pp_tp.build_pipeline(model, mesh, pcfg)
        assert pipe.stage_indices == [0, 3] and pipe.pcfg.stages_per_rank == 2
        assert load_config(CONFIG, [f"parallel.schedule={schedule}"], 4).parallel.stages_per_rank == 2
    explicit = dataclasses.replace(pcfg, stages_per_rank=1)
    with pytest.raises(ConfigError, match="needs exactly 2"):
        pp_tp.config.resolve_parallel(explicit, 2)


def test_check_and_build_resolve_the_default_embedding_alike(capsys, monkeypatch):
    """A tied model at tp > 1 on the default `parallel.embedding = "auto"`: `pp-tp check` prints the vocab-parallel
    embedding, and build_pipeline builds with it."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    overrides = ["model.tie_embeddings=true"]
    assert main(["check", "--config", CONFIG, "--world-size", "4", *overrides]) == 0
    assert 'embedding = "vocab_parallel"' in capsys.readouterr().out.splitlines()
    cfg = load_config(CONFIG, overrides, 4)
    assert cfg.parallel.embedding == "auto" and cfg.parallel.tp == 2
    with fake_world(4):
        mesh = init_device_mesh("cpu", mesh_shape(cfg.parallel, 4), mesh_dim_names=MESH_DIMS)
        pipe = pp_tp.build_pipeline(build_model(cfg.model, "meta"), mesh, cfg.parallel, seq_len=cfg.training.seq_len)
    assert pipe.pcfg.embedding == "vocab_parallel"
