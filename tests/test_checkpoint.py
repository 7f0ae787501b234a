"""DCP checkpoints: exact resume, loading at other layouts (pp, tp, dp, world size), atomic writes, keep-last-N.

One uninterrupted run saves every 2 steps and keeps 2 (its folder shows keep-last-N); every resume loads its step-4
checkpoint and runs steps 5 and 6 (the second of them proves the optimizer state was loaded too)."""

from __future__ import annotations

import os
import shutil

import pytest
from train_utils import job, train_case

# Saved at pp2 x tp2 on 4 ranks; each row loads its step-4 checkpoint at another layout.
LAYOUTS = [
    (4, {"pp": 4, "tp": 1, "dp_shard": 1, "microbatches": 4}),
    (4, {"pp": 1, "tp": 2, "dp_shard": 2, "microbatches": 2}),
    (4, {"pp": 1, "tp": 1, "dp_shard": 4, "microbatches": 2}),
    (2, {"pp": 2, "tp": 1, "dp_shard": 1, "microbatches": 2}),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, world):
    """An uninterrupted 6-step pp2 x tp2 run that checkpoints at steps 2, 4 and 6 and keeps the last 2."""
    folder = str(tmp_path_factory.mktemp("ckpt") / "run")
    d = job(checkpoint={"enable": True, "folder": folder, "interval": 2, "keep": 2})
    rows = world(4).run(train_case, d)
    return d, folder, rows


def test_every_rank_logs_the_same_global_loss_saves_atomically_and_keeps_the_last_2(saved):
    _, folder, rows = saved
    assert all(r == rows[0] for r in rows)
    assert [r["step"] for r in rows[0]] == [1, 2, 3, 4, 5, 6]
    assert 5.2 < rows[0][0]["loss"] < 5.8 and rows[0][-1]["loss"] < rows[0][0]["loss"] - 0.5
    assert sorted(os.listdir(folder)) == ["step-4", "step-6"]  # step-2 dropped (keep 2); no temporary directory left
    assert os.path.isfile(os.path.join(folder, "step-4", ".metadata"))


def _resume_from_step_4(saved, tmp_path, world_size, parallel, world):
    d, folder, rows = saved
    copy = str(tmp_path / "run")
    shutil.copytree(os.path.join(folder, "step-4"), os.path.join(copy, "step-4"))
    os.makedirs(os.path.join(copy, ".step-6.tmp"))  # a crashed save is not a checkpoint
    resumed = world(world_size).run(train_case, job(parallel=parallel, checkpoint={**d["checkpoint"], "folder": copy}))
    return rows[0], resumed[0]


@pytest.mark.parametrize("world_size, parallel", LAYOUTS, ids=["pp4", "pp1xtp2xdp2", "pp1xdp4", "pp2-on-2-ranks"])
def test_checkpoint_loads_at_another_layout_and_continues_with_the_same_loss(
    saved, tmp_path, world, world_size, parallel
):
    full, resumed = _resume_from_step_4(saved, tmp_path, world_size, parallel, world)
    assert [r["step"] for r in resumed] == [5, 6]
    for got, want in zip(resumed, full[4:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert got["lr"] == want["lr"]


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


def _resume_case(d: dict) -> tuple[str, list[dict]]:
    """Every rank: the resume's refusal line, or the fallback line and the metrics rows of the run."""
    from pp_tp.config import config_from_dict
    from pp_tp.errors import ConfigError
    from pp_tp.train.trainer import Trainer

    try:
        trainer = Trainer(config_from_dict(d))
    except ConfigError as e:
        return f"error: {e}", []
    return trainer.fallback_line, [{k: r[k] for k in ("step", "loss", "grad_norm", "lr")} for r in trainer.run()]


@pytest.mark.parametrize("how", ["truncated", "deleted"])
def test_a_damaged_shard_is_one_line_and_on_damaged_previous_resumes_from_the_intact_one(saved, tmp_path, world, how):
    """A save records each file's size and CRC-32; the resume checks the newest checkpoint first. Damaged: one line
    on every rank naming the file and step-4; with the key, the run goes on from step-4 at the saving layout, and its
    loss, grad norm and lr are the uninterrupted run's bit for bit (the exact resume; the layout tests resume beside a
    crashed save's temporary directory)."""
    d, folder, rows = saved
    copy = str(tmp_path / "run")
    shutil.copytree(folder, copy)
    shard = os.path.join(copy, "step-6", "__1_0.distcp")
    assert sorted(n for n in os.listdir(os.path.dirname(shard)) if n.startswith(".checksums-")) == [
        f".checksums-{r}.json" for r in range(4)
    ]
    if how == "truncated":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    else:
        os.remove(shard)
    ckpt = {**d["checkpoint"], "folder": copy}
    refused = world(4).run(_resume_case, job(checkpoint=ckpt))
    line = refused[0][0]
    assert all(r == (line, []) for r in refused) and "\n" not in line
    what = "bytes, " if how == "truncated" else "is missing"
    assert line.startswith(f"error: checkpoint {copy}/step-6 is damaged: {shard} ") and what in line, line
    assert f'the newest intact checkpoint is {copy}/step-4; set checkpoint.on_damaged = "previous"' in line, line
    resumed = world(4).run(_resume_case, job(checkpoint={**ckpt, "on_damaged": "previous"}))
    note, after = resumed[0]
    assert all(r == (note, after) for r in resumed)
    assert note.endswith(f'{copy}/step-4: resuming from it (checkpoint.on_damaged = "previous")'), note
    assert [r["step"] for r in after] == [5, 6] and after == rows[0][4:]
