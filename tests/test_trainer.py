"""The trainer end to end: `pp-tp train` runs 4 ranks from the shipped TOML and learns, and a bad config fails
before any rank is spawned. (Its pieces: test_lr_schedule, test_metrics, test_data_order, test_optimizer,
test_faults, test_nonfinite, test_checkpoint.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from train_utils import REPO, last_per_step


def test_pp_tp_train_runs_4_ranks_from_toml_and_learns(tmp_path):
    """The README's command on the shipped debug config, shortened: 4 ranks (pp2 x tp2) from the TOML."""
    metrics = tmp_path / "m.jsonl"
    ckpt = tmp_path / "ckpt"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pp_tp.cli",
            "train",
            "--config",
            "toml_configs/debug_cpu.toml",
            "--nproc",
            "4",
            "training.steps=10",
            "training.warmup_steps=2",
            "training.log_every=3",
            f"training.metrics_file={metrics}",
            f"checkpoint.folder={ckpt}",
            "checkpoint.interval=5",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = last_per_step(str(metrics))
    assert sorted(rows) == [3, 6, 9, 10]  # log_every=3 and the last step
    assert [line.split("|")[0].split()[1] for line in result.stdout.splitlines() if line.startswith("step")] == [
        "3",
        "6",
        "9",
        "10",
    ]
    assert 5.0 < rows[3]["loss"] < 5.6  # ln(256) = 5.55 at the start
    assert rows[10]["loss"] < rows[3]["loss"] - 0.8
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0 and r["grad_norm"] > 0 and "mfu" not in r
    assert sorted(os.listdir(ckpt)) == ["step-10", "step-5"]  # interval 5 (and the last step); keep 2


def test_bad_config_fails_before_spawning_any_rank(monkeypatch, capsys):
    from pp_tp.cli.main import main

    monkeypatch.chdir(REPO)
    monkeypatch.setattr("pp_tp.cli.launch.run_under_torchrun", lambda *a, **k: pytest.fail("ranks were spawned"))
    assert main(["train", "--config", "toml_configs/debug_cpu.toml", "--nproc", "4", "model.vocab_size=200"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model.vocab_size = 200") and len(err.splitlines()) == 1
