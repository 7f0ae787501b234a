"""Faults: a rank that dies is named by the survivors within the collective timeout, and torchrun's restart resumes
from the last checkpoint with the losses of an uninterrupted run."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys

import pytest
from train_utils import REPO, RESTART_JOB, job, last_per_step, to_toml, uninterrupted

KILL_ENTRY = os.path.join(os.path.dirname(__file__), "kill_entry.py")


def _rank_env(rank: int, world: int, port: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    return {
        **env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }


def test_a_dead_rank_is_named_by_the_survivors(tmp_path):
    """Ranks started without an agent (as on other nodes): rank 1 dies hard at step 3; the others must exit
    with an error naming it, within the collective timeout, never hang."""
    from harness import _free_port

    d = job(
        parallel={"pp": 3, "tp": 1, "microbatches": 3},
        model={"n_layers": 3},
        training={"batch_size": 6, "comm_timeout_s": 30},
    )
    cfg = tmp_path / "job.toml"
    cfg.write_text(to_toml(d))
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, KILL_ENTRY, "1:3", "--config", str(cfg)],
            cwd=REPO,
            env=_rank_env(r, 3, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert procs[1].returncode == 13
    for r in (0, 2):
        assert procs[r].returncode != 0
        assert f"PeerDiedError: rank {r}: step 3 failed because rank(s) [1] died" in outs[r][1], outs[r][1][-2000:]


def test_torchrun_max_restarts_resumes_from_the_last_checkpoint_with_the_same_losses(tmp_path, world):
    # sync saves: step 2's is complete when step 3 starts (an async one may still be writing when the kill comes;
    # tests/test_checkpoint_async.py kills inside a background write)
    d = copy.deepcopy(RESTART_JOB)
    d["checkpoint"]["async"] = False
    baseline = uninterrupted(world)
    assert [b["step"] for b in baseline] == [1, 2, 3, 4, 5]
    d["checkpoint"].update(enable=True, folder=str(tmp_path / "ckpt"))
    d["training"]["metrics_file"] = str(tmp_path / "m.jsonl")
    cfg = tmp_path / "job.toml"
    cfg.write_text(to_toml(d))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            KILL_ENTRY,
            "1:3",
            "--config",
            str(cfg),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "step-2 at step 2" in result.stdout
    rows = last_per_step(d["training"]["metrics_file"])
    assert sorted(rows) == [1, 2, 3, 4, 5]
    for base in baseline:
        assert rows[base["step"]]["loss"] == pytest.approx(base["loss"], rel=1e-6, abs=0)
        assert rows[base["step"]]["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-6, abs=0)
    assert math.isfinite(rows[5]["loss"]) and rows[5]["loss"] < rows[1]["loss"]
