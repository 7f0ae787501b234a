"""`checkpoint.async`: a save copies the state and DCP writes it in the background; the checkpoint counts only once
complete (renamed), a rank killed inside a background write leaves the last complete one, and the restarted run
has the uninterrupted run's losses. The key itself: default on where DCP's async_save can run, one line otherwise."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from test_faults import KILL_ENTRY
from torch.distributed.tensor import DTensor
from train_utils import REPO, RESTART_JOB, job, last_per_step, to_toml, uninterrupted

from pp_tp.cli.main import main
from pp_tp.config import CheckpointConfig, format_config, load_config
from pp_tp.errors import ConfigError

CONFIG = os.path.join(REPO, "toml_configs", "debug_cpu.toml")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _held_write_case(d: dict) -> dict:
    """Every rank: train, then save step 7 with DCP's file writes held back while the live parameters move on; what
    the folder shows meanwhile and after, and whether loading step 7 gives the parameters as they were at the save."""
    from torch.distributed.checkpoint import FileSystemWriter

    from pp_tp.config import config_from_dict
    from pp_tp.train.checkpoint import latest_checkpoint
    from pp_tp.train.trainer import Trainer

    trainer = Trainer(config_from_dict(d))
    trainer.run()
    ckpt, folder = trainer.checkpointer, d["checkpoint"]["folder"]
    params = [p for part in trainer.pipe.model_parts for p in part.parameters()]
    before = [_full(p.detach()).clone() for p in params]
    gate, write_data = threading.Event(), FileSystemWriter.write_data
    FileSystemWriter.write_data = lambda self, plan, planner: gate.wait(60) and write_data(self, plan, planner)
    try:
        ckpt.save(7)
        during = (latest_checkpoint(folder), sorted(os.listdir(folder)), ckpt.pending is not None)
        with torch.no_grad():
            for p in params:
                p.add_(1.0)  # the training goes on while the write waits
        gate.set()
        ckpt.wait()
    finally:
        FileSystemWriter.write_data = write_data
    after = (latest_checkpoint(folder), sorted(os.listdir(folder)))
    step = ckpt.load(after[0])
    exact = all(torch.equal(_full(p.detach()), b) for p, b in zip(params, before))
    return {"during": during, "after": after, "step": step, "exact": exact, "rank": dist.get_rank()}


def test_a_save_stages_a_copy_and_counts_only_once_written(tmp_path, world):
    folder = str(tmp_path / "run")
    d = job(training={"steps": 2}, checkpoint={"enable": True, "folder": folder, "interval": 1, "keep": 2})
    for r in world(4).run(_held_write_case, d):
        latest, names, in_flight = r["during"]
        assert in_flight and latest == os.path.join(folder, "step-2"), r
        assert names == [".step-7.tmp", "step-1", "step-2"], r
        assert r["after"] == (os.path.join(folder, "step-7"), ["step-2", "step-7"]), r
        assert r["step"] == 7 and r["exact"], r


def test_a_rank_killed_inside_a_background_write_resumes_from_the_last_complete_checkpoint(tmp_path, world):
    """torchrun, 2 ranks: rank 1 dies inside the background write of step 4 (its shard written, DCP's metadata not);
    the restart resumes from step 2, the last complete checkpoint, and logs the uninterrupted run's losses."""
    d = copy.deepcopy(RESTART_JOB)
    baseline = uninterrupted(world)
    d["checkpoint"].update(enable=True, folder=str(tmp_path / "ckpt"))
    d["training"]["metrics_file"] = str(tmp_path / "m.jsonl")
    cfg = tmp_path / "job.toml"
    cfg.write_text(to_toml(d))
    assert "async = true" in cfg.read_text()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
         KILL_ENTRY, "1:4:write", "--config", str(cfg)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exitcode  : 13" in result.stderr or "exitcode: 13" in result.stderr, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "step-2 at step 2" in result.stdout, result.stdout[-2000:]
    rows = last_per_step(d["training"]["metrics_file"])
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert [rows[b["step"]]["loss"] for b in baseline] == [b["loss"] for b in baseline]
    assert [rows[b["step"]]["grad_norm"] for b in baseline] == [b["grad_norm"] for b in baseline]
    assert sorted(os.listdir(d["checkpoint"]["folder"])) == ["step-4", "step-5"]


def test_the_key_defaults_on_where_async_save_runs_and_reads_as_toml():
    cfg = load_config(CONFIG)
    assert cfg.checkpoint.async_ is True and "async = true" in format_config(cfg)
    assert load_config(CONFIG, ["checkpoint.async=false"]).checkpoint.async_ is False
    with pytest.raises(ConfigError, match="^checkpoint.async = 1 has type integer; set checkpoint.async to a value"):
        load_config(CONFIG, ["checkpoint.async=1"])


def test_without_gloo_the_default_is_off_and_asking_for_it_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(dist, "is_gloo_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert CheckpointConfig().async_ is False
    assert main(["check", "--config", CONFIG, "--world-size", "4"]) == 0
    assert "async = false" in capsys.readouterr().out.splitlines()
    assert main(["check", "--config", CONFIG, "--world-size", "4", "checkpoint.async=true"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "error: checkpoint.async = true writes through DCP's async_save, whose background collectives need the gloo "
        "backend, and this torch build has none; set checkpoint.async = false"
    ]
