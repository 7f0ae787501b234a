"""`"auto"` FSDP policies in `pp-tp train`: resolved by the planner before anything starts, printed at startup,
and an impossible budget is one error line before any rank is spawned."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from train_utils import job, to_toml

from pp_tp.cli import launch
from pp_tp.cli.main import main
from pp_tp.config import config_from_dict
from pp_tp.planner import plan_job, resolve_auto

# pp2 on 2 ranks, bf16: FSDP (on a dp mesh of one) casts, gathers and reduces, so the policies matter.
AUTO = {"fsdp_reshard_after_forward": "auto", "fsdp_grad_reduce": "auto", "mixed_precision": "bf16"}


def _job(budget_gib: float, **training) -> dict:
    return job(
        parallel={"pp": 2, "tp": 1, "memory_budget_gib": budget_gib, **AUTO},
        training={"steps": 2, **training},
    )


def _tight_budget() -> float:
    """3 % under the peak of torch's own policies (default, step): auto must pick another on pp rank 0."""
    cfg = config_from_dict(_job(100.0), world_size=2)
    fixed = dataclasses.replace(cfg.parallel, fsdp_reshard_after_forward="default", fsdp_grad_reduce="step")
    return 0.97 * plan_job(dataclasses.replace(cfg, parallel=fixed), 2).peak_bytes / 2**30


def test_auto_resolves_to_the_planners_pick_and_trains(tmp_path):
    budget = _tight_budget()
    cfg, line = resolve_auto(config_from_dict(_job(budget), world_size=2), 2)
    assert line.startswith(f"FSDP policies (auto, parallel.memory_budget_gib = {budget:g}): pp rank 0: ")
    assert (cfg.parallel.fsdp_reshard_after_forward, cfg.parallel.fsdp_grad_reduce) != ("default", "step")
    path = tmp_path / "auto.toml"
    metrics = tmp_path / "m.jsonl"
    path.write_text(to_toml(_job(budget, metrics_file=str(metrics))))
    cmd = [sys.executable, "-m", "pp_tp.cli", "train", "--config", str(path), "--nproc", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert line in result.stdout  # the same pick, printed by rank 0 at startup
    assert "planner's estimate of each rank's peak" in result.stdout and "stages [0], estimated peak " in result.stdout
    assert "| process max RSS " in result.stdout  # the step log's peak, measured, says what it is
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)


def test_impossible_budget_is_one_line_before_anything_spawns(tmp_path, monkeypatch, capsys):
    path = tmp_path / "auto.toml"
    path.write_text(to_toml(_job(0.0001)))
    monkeypatch.setattr(launch, "run_under_torchrun", lambda *a: (_ for _ in ()).throw(AssertionError("spawned")))
    assert main(["train", "--config", str(path), "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.memory_budget_gib = 0.0001: no FSDP policy fits pp rank 0" in err[0]
    assert "smallest predicted peak" in err[0] and "dominated by" in err[0]
