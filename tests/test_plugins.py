"""Plugins: a model layout and a schedule found through an installed package's entry points, and the torchtitan
integration driven by a stand-in for torchtitan's Trainer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace as NS

import pytest
import torch

from pp_tp.errors import ConfigError
from pp_tp.integrations.torchtitan import parallel_config

PLUGIN_PKG = os.path.join(os.path.dirname(__file__), "plugin_pkg")

# Runs in a fresh process, so entry points are read after the install. One rank, pp1: discovery is the point.
# A [parallel] section naming the plugin's schedule must also pass config validation.
DISCOVER = """
import json, os
import torch, torch.nn.functional as F
import pp_tp
from pp_tp.config import ParallelConfig, config_from_dict
from pp_tp.schedules.registry import schedule_names
from pp_tp.stages.layouts import layout_for
from pp_tp_testplugin import TinyLM

os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
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
print(json.dumps({"layout": layout_for(model).name, "schedules": schedule_names(), "config": checked.parallel.schedule,
                  "schedule_class": type(pipe.schedule).__name__, "loss": loss,
                  "ref_loss": F.cross_entropy(ref(ids).flatten(0, 1), labels.flatten()).item()}))
"""


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory):
    src = tmp_path_factory.mktemp("plugin") / "pkg"
    shutil.copytree(PLUGIN_PKG, src)  # the build leaves build/ and *.egg-info beside the sources
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        pip + ["install", "--no-deps", "--no-build-isolation", str(src)], check=True, timeout=300, capture_output=True
    )
    yield
    subprocess.run(pip + ["uninstall", "-y", "pp_tp_testplugin"], check=True, timeout=300, capture_output=True)


def test_layout_and_schedule_come_from_an_installed_package(installed_plugin):
    from harness import _free_port

    result = subprocess.run(
        [sys.executable, "-c", DISCOVER],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PORT": str(_free_port())},
        cwd="/",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["layout"] == "tiny_mlp" and "PluginGPipe" in out["schedules"]
    assert out["config"] == "PluginGPipe"  # config validation knows the plugin's schedule
    assert out["schedule_class"] == "ScheduleGPipe"
    assert out["loss"] == pytest.approx(out["ref_loss"], rel=1e-5)
    assert 3.5 < out["loss"] < 5.0  # about ln(64) = 4.16 for a fresh model


# --- torchtitan -------------------------------------------------------------------------------------------


def _titan_sections(**parallelism) -> tuple[NS, NS]:
    p = dict(
        pipeline_parallel_degree=2,
        tensor_parallel_degree=1,
        data_parallel_replicate_degree=1,
        data_parallel_shard_degree=-1,
        pipeline_parallel_schedule="1F1B",
        pipeline_parallel_schedule_csv="",
        pipeline_parallel_microbatch_size=1,
        context_parallel_degree=1,
        expert_parallel_degree=1,
        fsdp_reshard_after_forward="default",
    )
    p.update(parallelism)
    training = NS(local_batch_size=4, global_batch_size=-1, seq_len=16, seed=3, mixed_precision_param="float32")
    return NS(**p), training


def titan_trainer_case(style: str) -> dict:
    """What torchtitan's Trainer does with a TrainSpec's pipelining_fn: build, to_empty + init_weights, step."""
    import torch.nn.functional as F
    from parity_utils import TINY, batch

    from pp_tp.integrations.torchtitan import pipelining_fn
    from pp_tp.models.reference.model import Transformer

    parallelism, training = _titan_sections()
    with torch.device("meta"):
        model = Transformer(TINY)
    if style == "positional":  # torchtitan <= 0.2: (model, parallel_dims, job_config, device, model_args, ...)
        schedule, parts, first, last = pipelining_fn(
            model, None, NS(parallelism=parallelism, training=training), torch.device("cpu"), TINY, None, None
        )
    else:  # newer torchtitan passes its config sections by keyword
        schedule, parts, first, last = pipelining_fn(
            model,
            parallel_dims=None,
            training=training,
            parallelism=parallelism,
            compile_config=None,
            ac_config=None,
            dump_folder="",
            device=torch.device("cpu"),
            model_config=TINY,
            parallelize_fn=None,
            loss_fn=None,
        )
    for m in parts:
        m.to_empty(device="cpu")
        with torch.no_grad():
            m.init_weights(buffer_device=None)
        m.train()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in parts]
    ids, labels = batch(TINY, 4, 16)
    got = []
    for _ in range(2):
        for o in opts:
            o.zero_grad()
        targets, losses = (labels, []) if last else (None, None)
        if first:
            schedule.step(ids, target=targets, losses=losses, input_batch=ids)
        elif style == "positional":  # older torchtitan gives middle/last stages no inputs at all
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step(target=targets, losses=losses, input_batch=ids)
        got.append(torch.mean(torch.stack(losses)).item() if last else -1.0)
        for o in opts:
            o.step()
    ref = Transformer(TINY)
    ref.init_weights(seed=3)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = []
    for _ in range(2):
        opt.zero_grad()
        loss = F.cross_entropy(ref(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        want.append(loss.item())
        opt.step()
    return {"first": first, "last": last, "got": got, "want": want}


@pytest.mark.parametrize("style", ["positional", "keyword"])
def test_torchtitan_trainer_drives_our_pipeline(world, style):
    r0, r1 = world(2).run(titan_trainer_case, style)
    assert (r0["first"], r0["last"], r1["first"], r1["last"]) == (True, False, False, True)
    assert r0["got"] == [-1.0, -1.0]
    for got, want in zip(r1["got"], r1["want"]):
        assert got == pytest.approx(want, rel=1e-5)
    assert r1["got"][1] < r1["got"][0]


@pytest.mark.parametrize(
    "parallelism, training, fragment",
    [
        ({"context_parallel_degree": 2}, {}, "parallelism.context_parallel_degree = 2"),
        ({}, {"global_batch_size": 16}, "gradient accumulation"),
        (
            {"pipeline_parallel_microbatch_size": 3},
            {},
            "not divisible by parallelism.pipeline_parallel_microbatch_size",
        ),
    ],
)
def test_torchtitan_config_we_cannot_honour_is_refused(monkeypatch, parallelism, training, fragment):
    monkeypatch.setenv("WORLD_SIZE", "2")
    p, t = _titan_sections(**parallelism)
    for k, v in training.items():
        setattr(t, k, v)
    with pytest.raises(ConfigError, match=fragment):
        parallel_config(p, t)


def test_torchtitan_schedule_maps_to_our_parallel_config(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    pcfg = parallel_config(*_titan_sections(pipeline_parallel_schedule="Interleaved1F1B", tensor_parallel_degree=2))
    assert (pcfg.pp, pcfg.tp, pcfg.dp_shard, pcfg.stages_per_rank, pcfg.microbatches) == (2, 2, 2, 2, 4)
