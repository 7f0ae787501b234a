"""Plugins: a model layout and a schedule found through an installed package's entry points (the torchtitan
integration is tested against the real package in tests/test_torchtitan.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

PLUGIN_PKG = os.path.join(os.path.dirname(__file__), "plugin_pkg")

# Runs in a fresh process, so entry points are read after the install. One rank, pp1: discovery is the point.
# A [parallel] section naming the plugin's schedule must also pass config validation, and `pp-tp check` (in this same
# process: test_cli_check starts the entry point itself) names the plugin's data source when a job misspells it.
DISCOVER = """
import contextlib, io, json, os, sys
import torch, torch.nn.functional as F
import pp_tp
from pp_tp.config import ParallelConfig, config_from_dict
from pp_tp.schedules.registry import schedule_names
from pp_tp.layout import layout_for
from pp_tp.cli.main import main
from pp_tp_testplugin import TinyLM

os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # one rank: the store binds any
with torch.device("meta"):
    model = TinyLM()
pcfg = ParallelConfig(pp=1, dp_shard=1, schedule="PluginGPipe", microbatches=2, mixed_precision="fp32")
pipe = pp_tp.build_pipeline(model, pp_tp.build_mesh(pcfg), pcfg, seed=0)
gen = torch.Generator().manual_seed(0)
ids, labels = torch.randint(0, 64, (4, 8), generator=gen), torch.randint(0, 64, (4, 8), generator=gen)
loss = pipe.step(ids, labels).item()
ref = TinyLM()
ref.load_state_dict(pipe.model_parts[0].state_dict())
checked = config_from_dict({"parallel": {"pp": 2, "schedule": "PluginGPipe", "microbatches": 2}}, world_size=2)
with contextlib.redirect_stderr(io.StringIO()) as err:
    code = main(["check", "--config", sys.argv[1], "--world-size", "2", "data.source=countin"])
print(json.dumps({"layout": layout_for(model).name, "schedules": schedule_names(), "config": checked.parallel.schedule,
                  "check": [code, err.getvalue()], "schedule_class": type(pipe.schedule).__name__, "loss": loss,
                  "ref_loss": F.cross_entropy(ref(ids).flatten(0, 1), labels.flatten()).item()}))
"""


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory) -> dict[str, str]:
    """The plugin installed into a folder of this test's own (pip --target), and the environment that puts it on the
    path of the processes a test starts: site-packages stays untouched, so tests running beside these
    (pytest -n) never see the plugin's entry points."""
    root = tmp_path_factory.mktemp("plugin")
    src, target = root / "pkg", root / "site"
    shutil.copytree(PLUGIN_PKG, src)  # the build leaves build/ and *.egg-info beside the sources
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        pip + ["install", "--no-deps", "--no-build-isolation", "--target", str(target), str(src)],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    path = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def test_layout_and_schedule_come_from_an_installed_package(installed_plugin, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(PLUGIN_JOB.format(metrics=tmp_path / "metrics.jsonl"))
    result = subprocess.run(
        [sys.executable, "-c", DISCOVER, str(job)],
        capture_output=True,
        text=True,
        timeout=300,
        env=installed_plugin,
        cwd="/",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["layout"] == "tiny_mlp" and "PluginGPipe" in out["schedules"]
    assert out["config"] == "PluginGPipe"  # config validation knows the plugin's schedule
    assert out["schedule_class"] == "ScheduleGPipe"
    assert out["loss"] == pytest.approx(out["ref_loss"], rel=1e-5)
    assert 3.5 < out["loss"] < 5.0  # about ln(64) = 4.16 for a fresh model
    code, err = out["check"]  # a misspelt source: one line naming the plugin's source among the known ones
    assert code == 2 and "data.source = 'countin'" in err and "counting" in err and len(err.splitlines()) == 1, err


PLUGIN_JOB = """
[model]
kind = "tiny_mlp"
vocab_size = 64
dim = 32
n_layers = 4
n_heads = 1
n_kv_heads = 1
hidden = 48
[parallel]
pp = 2
dp_shard = 1
schedule = "1F1B"
microbatches = 2
mixed_precision = "fp32"
[training]
steps = 30
batch_size = 8
seq_len = 16
lr = 1e-2
warmup_steps = 2
log_every = 10
metrics_file = "{metrics}"
[data]
source = "counting"
[checkpoint]
enable = false
"""


def test_a_plugin_model_kind_and_data_source_train_from_toml_at_pp2(installed_plugin, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    job = tmp_path / "job.toml"
    job.write_text(PLUGIN_JOB.format(metrics=metrics))
    cmd = [sys.executable, "-m", "pp_tp.cli", "train", "--config", str(job), "--nproc", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(tmp_path), env=installed_plugin)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 3 and losses[0] > 3.0, losses  # about ln(64) = 4.16 at the start
    assert losses[2] < losses[1] < losses[0] and losses[2] < 0.9 * losses[0], losses  # measured 3.96, 3.56, 3.35
