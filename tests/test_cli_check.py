"""`pp-tp check` as a user runs it: a resolved config and exit 0, or one `error:` line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

GOOD_TOML = """
[parallel]
pp = 2
tp = 2
microbatches = 4
"""


def run_check(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    return subprocess.run(
        [sys.executable, "-m", "pp_tp.cli", "check", *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(GOOD_TOML)
    return str(path)


def test_good_config_prints_the_resolved_config(good):
    result = run_check("--config", good, "--world-size", "8", "parallel.schedule=GPipe")
    assert result.returncode == 0, result.stderr
    assert "dp_shard = 2" in result.stdout and 'schedule = "GPipe"' in result.stdout
    assert result.stderr == ""


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--world-size", "6"], "parallel.dp_shard = -1 cannot fill world size 6"),
        (["--world-size", "8", "parallel.schedule=1F1b"], "did you mean '1F1B'"),
    ],
)
def test_bad_config_is_one_error_line(good, args, fragment, monkeypatch, capsys):
    """In process (the entry point's own output is checked above): exit code 2, one line on stderr, nothing else."""
    from pp_tp.cli.main import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["check", "--config", good, *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0]
