"""`pp-tp parity`: a user's config against its non-PP build, on spawned local ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pp_tp.cli.parity import format_table

CONFIG = """
[model]
vocab_size = 96
dim = 32
n_layers = 4
n_heads = 4
n_kv_heads = 2
ffn_dim = 48
max_seq_len = 32
[parallel]
pp = 2
schedule = "Interleaved1F1B"
stages_per_rank = 2
microbatches = 2
mixed_precision = "fp32"
[training]
batch_size = 4
seq_len = 16
lr = 1e-3
"""


def _run(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    path = tmp_path / "job.toml"
    path.write_text(CONFIG)
    return subprocess.run(
        [sys.executable, "-m", "pp_tp.cli", "parity", "--config", str(path), *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_parity_command_passes_and_prints_a_row_per_step(tmp_path):
    out = _run(tmp_path, "--nproc", "2", "--steps", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip().endswith("ok")]
    assert [r[0] for r in rows] == ["1", "2"]
    for r in rows:  # three losses, then per kind pipelined/plain distances to the float64 truth, the score
        assert abs(float(r[1]) - float(r[3])) < 1e-5 * float(r[3]), out.stdout
        pipe = [float(pair.split("/")[0]) for pair in r[4:8]]
        assert max(pipe) < 1e-5 and float(r[8]) <= 1.0, out.stdout


def test_parity_command_refuses_a_bad_world_before_spawning(tmp_path, monkeypatch, capsys):
    """In process (the entry point itself runs above): exit 2, one `error:` line, and no rank spawned."""
    from pp_tp.cli import launch
    from pp_tp.cli.main import main

    path = tmp_path / "job.toml"
    path.write_text(CONFIG)
    monkeypatch.setattr(launch, "run_under_torchrun", lambda *a, **k: pytest.fail("ranks were spawned"))
    assert main(["parity", "--config", str(path), "--nproc", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_parity_table_marks_failures():
    figures = [0.0, 0.0, 0.0, 3e-2, 1e-7, 3e4, 2e-6, 0.0, 0.25, 0.0, 0.0, 0.0]
    table = format_table([(1, 2.0, 2.1, 2.1, *figures, 3e4, "FAIL")])
    assert "FAIL" in table and "3.00e-02/1.00e-07" in table and "2.00e-06" in table
