"""torchtitan 0.3.0's real `Trainer(config).train()` on CPU/gloo with pp_tp's `model_spec`: the llama3 and qwen3 MoE
models of test_torchtitan.py (vocabulary 512, the shipped tiny tokenizer's), a few steps on a jsonl folder made in
tmp, torchtitan's default fused AdamW and its `clip_grad_norm_` (max_norm below the gradient norm, so the clip
scales and its norm must be right).

- llama3 at pp2 and at pp2 x tp2: the logged losses and gradient norms equal torchtitan's own non-PP run and its own
  pp2 run from the same weights and data (torchtitan's parts get pp_tp's (seed, FQN) init here, so all start equal).
- torchtitan's checkpointer saves each step; a second Trainer resumes from step 1 and logs what the uninterrupted
  run logged for steps 2 and 3.
- qwen3 MoE at pp2 x ep2 (dp_shard 2, spmd_backend "full_dtensor"): losses and gradient norms equal torchtitan's
  non-PP run at dp_shard 2, and the expert biases its MoE load-balancing hook (an optimizer pre-step hook) updates on
  pp_tp's parts equal the reference's after the run.
- FSDP x TP (pp2 x tp2 in bf16, no Trainer): every parameter of a part on one mesh, torchtitan's clip_grad_norm_
  gives pp_tp's whole-model norm, its fused AdamW steps.

Test-only stand-ins, for torchtitan's own code on this machine: its device module (it picks "cuda" with no
accelerator) becomes a CPU one; the references get `torch.distributed.set_timeout` as pp_tp's model_spec installs
it, their FSDP reduces with a plain sum (gloo has no PREMUL_SUM) and torchtitan's own pp2 schedule gets the
microbatch `step` torch 2.13's schedules lack; the trainer's closing 2 s sleep on rank 0 is skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import os
import shutil
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

pytest.importorskip("torchtitan")

import torch  # noqa: E402
from harness import PG_TIMEOUT_S  # noqa: E402
from titan_utils import _batch, _build, llama3_config, qwen3_moe_config  # noqa: E402

from pp_tp.integrations.torchtitan import model_spec  # noqa: E402
from pp_tp.integrations.torchtitan_compat import install_set_timeout  # noqa: E402
from pp_tp.integrations.torchtitan_parts import init_part, init_rules  # noqa: E402
from pp_tp.parallel.grads import total_grad_norm  # noqa: E402

VOCAB, SEQ, LBS, STEPS = 512, 32, 4, 3
REPO = Path(__file__).resolve().parent.parent
MODELS = {"llama3": ("llama3", "debugmodel"), "qwen3_moe": ("qwen3", "debugmodel_moe")}


def _time_without_sleep() -> types.ModuleType:
    """torchtitan's trainer module's `time`, less its 2 s sleep on rank 0 after the last step ("for other ranks to
    complete"): the world waits for every rank's answer anyway, and 7 Trainer runs here slept 14 s."""
    stand_in = types.ModuleType("time")
    stand_in.__dict__.update(vars(time))
    stand_in.sleep = lambda seconds: None
    return stand_in


@contextlib.contextmanager
def cpu_device() -> Iterator[None]:
    """torchtitan's device module as a CPU stand-in while a Trainer runs: with no accelerator torchtitan still picks
    "cuda" (tools.utils.get_device_info). Every loaded torchtitan module's bound names are patched and restored, and
    the trainer's closing sleep is skipped (_time_without_sleep)."""
    import torchtitan.tools.utils as tu
    import torchtitan.trainer

    noop = lambda *a, **k: None  # noqa: E731
    cpu = types.SimpleNamespace(
        set_device=noop, device_count=lambda: 1, current_device=lambda: 0, get_device_name=lambda *a: "cpu",
        get_device_properties=lambda *a: types.SimpleNamespace(total_memory=1 << 30), reset_peak_memory_stats=noop,
        empty_cache=noop, synchronize=noop, memory_stats=lambda *a: {},
    )  # fmt: skip
    originals = {"device_module": (tu.device_module, cpu), "device_type": (tu.device_type, "cpu")}
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torchtitan.trainer, "time", _time_without_sleep()))
        for module in [m for name, m in sys.modules.items() if name.startswith("torchtitan")]:
            for attr, (old, new) in originals.items():
                if getattr(module, attr, None) is old:
                    stack.enter_context(mock.patch.object(module, attr, new))
        try:
            yield
        finally:
            gc.enable()  # the Trainer turns automatic collection off; this world runs other tests next


def make_inputs(root: Path) -> None:
    """root/assets: the shipped tiny tokenizer (512 tokens); root/data/data.json: the shipped text, 4 lines a row."""
    (root / "assets").mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "toml_configs" / "hf_tiny" / name, root / "assets" / name)
    lines = [s for s in (REPO / "pp_tp" / "data" / "patterns.txt").read_text().splitlines() if s.strip()]
    (root / "data").mkdir()
    rows = (json.dumps({"text": " ".join(lines[i : i + 4])}) for i in range(0, len(lines), 4))
    (root / "data" / "data.json").write_text("\n".join(rows) + "\n")


# --- torchtitan's own references: pp_tp's init on their parts, and what they need on torch 2.13 / gloo -----------


def _seed_and_sum(part: torch.nn.Module, rules: dict, n_layers: int) -> None:
    from torch.distributed.fsdp import FSDPModule

    part.init_weights = functools.partial(init_part, part, 0, rules, n_layers)
    for module in part.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def _seeded_parallelize(fn: Callable) -> Callable:
    def wrapped(model: torch.nn.Module, **kw: Any) -> torch.nn.Module:
        rules, n = init_rules(model), len(model.layers)
        out = fn(model, **kw)
        _seed_and_sum(out, rules, n)
        return out

    return wrapped


class MicrobatchSchedule:
    """torchtitan's own pp schedule, stepped with its microbatch lists: torch 2.13's schedules take whole batches."""

    def __init__(self, schedule: Any):
        self.schedule = schedule

    def step(self, *, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, loss_kwargs=None, **_: Any) -> None:
        s = self.schedule
        for stage in getattr(s, "_stages", None) or [s._stage]:
            stage.has_backward = s._has_backward
            stage.clear_runtime_states()
        s._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, False, loss_kwargs=loss_kwargs)


def _seeded_pipelining(fn: Callable) -> Callable:
    def wrapped(model: torch.nn.Module, **kw: Any) -> tuple:
        rules, n = init_rules(model), len(model.layers)
        schedule, parts, first, last = fn(model, **kw)
        for part in parts:
            _seed_and_sum(part, rules, n)
        return MicrobatchSchedule(schedule), parts, first, last

    return wrapped


def spec(model: str, ours: bool) -> Any:
    """pp_tp's model_spec, or torchtitan's own spec made comparable (above); the tiny model of test_torchtitan.py."""
    name, flavor = MODELS[model]
    if ours:
        out = model_spec(name, flavor, seed=0)
    else:
        from importlib import import_module

        install_set_timeout()  # torchtitan's own Trainer needs it on torch 2.13 (pp_tp's model_spec installs it)
        out = import_module(f"torchtitan.models.{name}").model_registry(flavor)
        out = dataclasses.replace(
            out,
            parallelize_fn=_seeded_parallelize(out.parallelize_fn),
            pipelining_fn=_seeded_pipelining(out.pipelining_fn),
        )
    config = llama3_config(vocab=VOCAB) if model == "llama3" else qwen3_moe_config(vocab=VOCAB)
    return dataclasses.replace(out, model=config, flavor="tiny")


def trainer_config(
    root: Path, run: str, ours: bool, model: str, pp: int, tp: int = 1, ep: int = 1, spmd: str = "", **ckpt: Any
) -> Any:
    """A Trainer.Config: fp32, local batch 4, microbatch 1, STEPS steps, clip at 0.5, dump folder root/run. spmd_backend
    `spmd` or: the default "spmd_types" for pp_tp, "partial_dtensor" for the references (under "spmd_types"
    torchtitan's own FSDP refuses its own plain parameters)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CommConfig, ParallelismConfig, TrainingConfig
    from torchtitan.config.configs import DebugConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.trainer import Trainer

    training = TrainingConfig(
        local_batch_size=LBS, seq_len=SEQ, steps=STEPS, max_norm=0.5, mixed_precision_param="float32",
        disable_cuda_graphs=True,
    )  # fmt: skip
    parallelism = ParallelismConfig(
        pipeline_parallel_degree=pp, tensor_parallel_degree=tp, expert_parallel_degree=ep,
        pipeline_parallel_microbatch_size=1, spmd_backend=spmd or ("spmd_types" if ours else "partial_dtensor"),
    )  # fmt: skip
    return Trainer.Config(
        model_spec=spec(model, ours), hf_assets_path=str(root / "assets"), dump_folder=str(root / run),
        loss=CrossEntropyLoss.Config(global_vocab_size=VOCAB), optimizer=default_adamw(lr=3e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=1),
        training=training, parallelism=parallelism,
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(root / "data")),
        metrics=MetricsProcessor.Config(log_freq=1), comm=CommConfig(train_timeout_seconds=PG_TIMEOUT_S),
        checkpoint=CheckpointManager.Config(**ckpt), activation_checkpoint=None, debug=DebugConfig(seed=42),
    )  # fmt: skip


def train(config: Any) -> dict:
    """Runs `Trainer(config).train()`; what it logged (loss, grad norm per step, on the ranks holding the loss) and the
    expert biases this rank's parts hold after the run."""
    from torchtitan.trainer import Trainer

    logged: dict[int, tuple[float, float]] = {}
    with cpu_device():
        trainer = Trainer(config)
        log = trainer.metrics_processor.log

        def record(step: int, loss: float, max_loss: float, grad_norm: float, **kw: Any) -> None:
            logged[step] = (loss, grad_norm)
            log(step, loss, max_loss, grad_norm, **kw)

        trainer.metrics_processor.log = record
        try:
            trainer.train()
        finally:
            trainer.close()
    biases = {k: b.clone() for m in trainer.model_parts for k, b in m.named_buffers() if k.endswith("expert_bias_E")}
    return {"logged": {s: v for s, v in logged.items() if v[0] > 0}, "bias": biases}


# --- the worlds: as few as the batch layouts allow (a Trainer takes the whole world) ----------------------------


def one_rank_runs(root: str) -> dict:
    """torchtitan's own non-PP llama3, batch degree 1 (the data of every llama3 run here)."""
    return {"titan": train(trainer_config(Path(root), "titan", False, "llama3", pp=1))}


def two_rank_runs(root: str) -> dict:
    """torchtitan's own llama3 at pp2, pp_tp's at pp2, torchtitan's own non-PP MoE at dp_shard 2."""
    r = Path(root)
    return {
        "titan_pp2": train(trainer_config(r, "titan_pp2", False, "llama3", pp=2)),
        "pp2": train(trainer_config(r, "pp2", True, "llama3", pp=2)),
        "titan_moe": train(trainer_config(r, "titan_moe", False, "qwen3_moe", pp=1)),
    }


def four_rank_runs(root: str) -> dict:
    """pp_tp's llama3 at pp2 x tp2 saving each step, then resumed from step 1; pp_tp's MoE at pp2 x ep2 with
    spmd_backend "full_dtensor" (its inputs come as DTensors sharded over dp)."""
    r = Path(root)
    out = {"tp2": train(trainer_config(r, "tp2", True, "llama3", pp=2, tp=2, enable=True, interval=1))}
    out["saved"] = sorted(os.listdir(r / "tp2" / "checkpoint"))
    resume = dict(enable=True, load_step=1, load_only=True)
    out["resumed"] = train(trainer_config(r, "tp2", True, "llama3", pp=2, tp=2, **resume))
    out["moe"] = train(trainer_config(r, "moe", True, "qwen3_moe", pp=2, ep=2, spmd="full_dtensor"))
    return out


@pytest.fixture(scope="module")
def runs(world, tmp_path_factory) -> dict:
    """Every run's results, per rank: {"1": [rank 0], "2": [rank 0, rank 1], "4": [...]}."""
    root = tmp_path_factory.mktemp("titan_trainer")
    make_inputs(root)
    return {n: world(n).run(fn, str(root)) for n, fn in ((1, one_rank_runs), (2, two_rank_runs), (4, four_rank_runs))}


def logged(per_rank: list[dict], run: str) -> dict[int, tuple[float, float]]:
    """One run's logged (loss, grad norm) per step, from the ranks that log the loss (all of them alike)."""
    seen = [r[run]["logged"] for r in per_rank if r[run]["logged"]]
    assert seen and all(s == seen[0] for s in seen), (run, seen)
    return seen[0]


def assert_same(got: dict, want: dict, rel: float) -> None:
    assert sorted(got) == sorted(want), (got, want)
    for step, (loss, norm) in want.items():
        assert got[step][0] == pytest.approx(loss, rel=rel) and got[step][1] == pytest.approx(norm, rel=rel), (
            step,
            got,
            want,
        )


def test_llama3_at_pp2_and_pp2_tp2_logs_torchtitans_own_losses_and_grad_norms(runs):
    want = logged(runs[1], "titan")
    assert sorted(want) == list(range(1, STEPS + 1)), want
    assert all(5.0 < loss < 8.0 for loss, _ in want.values()), want  # ln(512) = 6.2 for a fresh model
    assert want[1][1] > 0.6, want  # above max_norm 0.5: the clip scales, so its norm must be right
    assert want[STEPS][0] < want[1][0], want
    assert_same(logged(runs[2], "titan_pp2"), want, rel=1e-5)
    assert_same(logged(runs[2], "pp2"), want, rel=1e-5)
    assert_same(logged(runs[4], "tp2"), want, rel=1e-5)


def test_checkpointer_saves_and_a_second_trainer_resumes_with_the_same_losses(runs):
    assert runs[4][0]["saved"] == [f"step-{s}" for s in range(1, STEPS + 1)], runs[4][0]["saved"]
    whole = logged(runs[4], "tp2")
    assert_same(logged(runs[4], "resumed"), {s: v for s, v in whole.items() if s > 1}, rel=1e-6)


def test_qwen3_moe_at_pp2_ep2_equals_torchtitan_and_its_balancing_hook_runs_on_our_parts(runs):
    want = logged(runs[2], "titan_moe")
    assert sorted(want) == list(range(1, STEPS + 1)) and all(5.0 < loss < 8.0 for loss, _ in want.values()), want
    assert_same(logged(runs[4], "moe"), want, rel=1e-5)
    ref = runs[2][0]["titan_moe"]["bias"]
    ours = {k: b for r in runs[4] for k, b in r["moe"]["bias"].items()}
    assert sorted(ours) == sorted(ref) == [f"layers.{i}.moe.expert_bias_E" for i in range(4)], (ours, ref)
    for k, b in ref.items():
        assert float(b.abs().sum()) > 0 and torch.allclose(ours[k], b, rtol=0, atol=1e-7), (k, ours[k], b)


def fsdp_tp_case() -> dict:
    """pp2 x tp2 in bf16 (pp_tp's FSDP wraps the stages for the casts even at dp 1): after a step, each part's
    meshes, torchtitan's clip_grad_norm_ (no scaling) beside pp_tp's whole-model norm, and a fused AdamW step."""
    from torchtitan.distributed.utils import clip_grad_norm_

    schedule, parts, _, _ = _build("llama3", pp=2, tp=2, precision="bfloat16")
    ids, labels, _ = _batch()
    schedule.step(ids, target=labels)
    params = [p for m in parts for p in m.parameters()]
    titan = clip_grad_norm_(params, 1e9, foreach=True, pp_mesh=schedule.pipe.mesh["pp"])
    torch.optim.AdamW(params, lr=1e-3, fused=True).step()
    meshes = [{p.device_mesh.mesh_dim_names for p in m.parameters()} for m in parts]
    return {"meshes": meshes, "titan": float(titan), "ours": float(total_grad_norm(parts, schedule.pipe.mesh))}


def test_fsdp_x_tp_parts_hold_one_mesh_for_torchtitans_clip_and_fused_adamw(world):
    for r in world(4).run(fsdp_tp_case):
        assert r["meshes"] == [{("dp_shard", "tp")}], r  # every parameter: FSDP on dp_shard x TP (or Replicate) on tp
        assert r["titan"] == pytest.approx(r["ours"], rel=1e-5) and r["ours"] > 0, r
