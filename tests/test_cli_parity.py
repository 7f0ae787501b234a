"""`pp-tp parity`: a user's config against its non-PP build, on spawned local ranks."""

from __future__ import annotations

import subprocess
import sys

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
    assert all(float(x) < 1e-5 for r in rows for x in r[3:7]), out.stdout  # loss, grads, params, buffers


def test_parity_command_refuses_a_bad_world_before_spawning(tmp_path):
    out = _run(tmp_path, "--nproc", "3")
    assert out.returncode == 2 and out.stderr.startswith("error: ") and "Traceback" not in out.stderr


def test_parity_table_marks_failures():
    table = format_table([(1, 2.0, 2.1, 0.05, 1e-3, 2e-6, 0.0, "FAIL")], 1e-4)
    assert "FAIL" in table and "5.00e-02" in table and "2.00e-06" in table
