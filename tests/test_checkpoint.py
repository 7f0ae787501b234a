"""DCP checkpoints: exact resume, loading at other layouts (pp, tp, dp, world size), atomic writes, keep-last-N."""

from __future__ import annotations

import os
import shutil

import pytest
from train_utils import job, train_case

# Saved at pp2 x tp2 on 4 ranks; each row loads its step-3 checkpoint at another layout.
LAYOUTS = [
    (4, {"pp": 4, "tp": 1, "dp_shard": 1, "microbatches": 4}),
    (4, {"pp": 1, "tp": 2, "dp_shard": 2, "microbatches": 2}),
    (4, {"pp": 1, "tp": 1, "dp_shard": 4, "microbatches": 2}),
    (2, {"pp": 2, "tp": 1, "dp_shard": 1, "microbatches": 2}),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, world):
    """An uninterrupted 6-step pp2 x tp2 run that checkpoints at steps 3 and 6."""
    folder = str(tmp_path_factory.mktemp("ckpt") / "run")
    d = job(checkpoint={"enable": True, "folder": folder, "interval": 3, "keep": 2})
    rows = world(4).run(train_case, d)
    return d, folder, rows


def test_every_rank_logs_the_same_global_loss_and_saves_atomically(saved):
    _, folder, rows = saved
    assert all(r == rows[0] for r in rows)
    assert [r["step"] for r in rows[0]] == [1, 2, 3, 4, 5, 6]
    assert 5.2 < rows[0][0]["loss"] < 5.8 and rows[0][-1]["loss"] < rows[0][0]["loss"] - 0.5
    assert sorted(os.listdir(folder)) == ["step-3", "step-6"]  # no temporary directory left
    assert os.path.isfile(os.path.join(folder, "step-3", ".metadata"))


def _resume_from_step_3(saved, tmp_path, world_size, parallel, world):
    d, folder, rows = saved
    copy = str(tmp_path / "run")
    shutil.copytree(os.path.join(folder, "step-3"), os.path.join(copy, "step-3"))
    os.makedirs(os.path.join(copy, ".step-6.tmp"))  # a crashed save is not a checkpoint
    resumed = world(world_size).run(train_case, job(parallel=parallel, checkpoint={**d["checkpoint"], "folder": copy}))
    return rows[0], resumed[0]


def test_resume_is_exact(saved, tmp_path, world):
    full, resumed = _resume_from_step_3(saved, tmp_path, 4, saved[0]["parallel"], world)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert resumed == full[3:]  # bit-identical loss, grad norm and lr


@pytest.mark.parametrize("world_size, parallel", LAYOUTS, ids=["pp4", "pp1xtp2xdp2", "pp1xdp4", "pp2-on-2-ranks"])
def test_checkpoint_loads_at_another_layout_and_continues_with_the_same_loss(
    saved, tmp_path, world, world_size, parallel
):
    full, resumed = _resume_from_step_3(saved, tmp_path, world_size, parallel, world)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for got, want in zip(resumed, full[3:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert got["lr"] == want["lr"]


def test_keep_drops_the_oldest(tmp_path, world):
    folder = str(tmp_path / "run")
    world(4).run(
        train_case, job(training={"steps": 3}, checkpoint={"enable": True, "folder": folder, "interval": 1, "keep": 2})
    )
    assert sorted(os.listdir(folder)) == ["step-2", "step-3"]


def test_per_part_split_weights_checkpoint_and_load_at_another_layout(tmp_path, world):
    """TP of experts splits the packed gate/up per part (`_StridedShard`: not one box of the global tensor, which
    DCP's chunks are): saved at pp2 x tp2, loaded at pp2 x ep2, the run continues with the uninterrupted losses."""
    moe = {"n_experts": 4, "top_k": 2, "moe_ffn_dim": 32}
    folder = str(tmp_path / "run")
    d = job(model=moe, checkpoint={"enable": True, "folder": folder, "interval": 3, "keep": 2})
    full = world(4).run(train_case, d)[0]
    shutil.rmtree(os.path.join(folder, "step-6"))
    ep = {"pp": 2, "tp": 1, "dp_shard": 2, "ep": 2, "microbatches": 4}
    resumed = world(4).run(train_case, job(model=moe, parallel=ep, checkpoint=d["checkpoint"]))[0]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for got, want in zip(resumed, full[3:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
