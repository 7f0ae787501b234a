"""`pp-tp plan`: the dry run's accounting against hand counts and a real forward, its schedule table, a
405B-like job at 1024 ranks, and the command line (one error line on bad input)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pp_tp
from pp_tp.layout import layout_for
from pp_tp.models.factory import build_model
from pp_tp.parallel.activation_checkpoint import apply_activation_checkpoint
from pp_tp.planner import SavedActivations, peak_held_bytes, plan_job
from pp_tp.planner.schedule_sim import schedule_actions
from pp_tp.runtime.loss import TokenSumLoss
from pp_tp.split.plan import plan_stages
from pp_tp.stages.stage_module import StageModule

TINY = """
[model]
vocab_size = 256
dim = 64
n_layers = 4
n_heads = 4
n_kv_heads = 2
ffn_dim = 128
max_seq_len = 32

[parallel]
pp = 2
tp = {tp}
dp_shard = -1
schedule = "1F1B"
microbatches = 4
mixed_precision = "{mp}"
activation_checkpoint = "{ac}"

[training]
batch_size = 16
seq_len = 32
"""

LLAMA_405B_LIKE = """
[model]
vocab_size = 128256
dim = 16384
n_layers = 126
n_heads = 128
n_kv_heads = 8
ffn_dim = 53248
max_seq_len = 8192

[parallel]
pp = 16
tp = 8
dp_shard = -1
schedule = "Interleaved1F1B"
stages_per_rank = 2
microbatches = 32
mixed_precision = "bf16"

[training]
batch_size = 256
seq_len = 8192
"""

# Weights the reference TP plan shards over tp; everything else is replicated on TP ranks.
TP_SHARDED = (
    "wq.weight",
    "wk.weight",
    "wv.weight",
    "wo.weight",
    "w1.weight",
    "w2.weight",
    "w3.weight",
    "output.weight",
)


def job(tmp_path, text: str, world: int, **fmt):
    path = tmp_path / "job.toml"
    path.write_text(text.format(**{"ac": "none", **fmt}) if fmt else text)
    return pp_tp.load_config(str(path), world_size=world)


def test_parameter_bytes_follow_tp_and_fsdp_sharding(tmp_path):
    cfg = job(tmp_path, TINY, 8, tp=2, mp="bf16")  # pp2 x dp_shard2 x tp2
    plan = plan_job(cfg, 8)
    model = build_model(cfg.model)
    for r in plan.ranks:
        names = [f for s in plan.plan.for_rank(r.pp_rank) for f in s.fqns]
        params = {k: p.numel() for f in names for k, p in model.get_submodule(f).named_parameters(prefix=f)}
        tp_local = {k: n // (2 if k.endswith(TP_SHARDED) else 1) for k, n in params.items()}
        assert r.local_params == sum(tp_local.values()) // 2  # FSDP over dp_shard = 2
        assert r.param_bytes == r.grad_bytes == 4 * r.local_params and r.optim_bytes == 8 * r.local_params
        assert r.gathered_bytes == 2 * sum(tp_local.values())  # bf16 copy, kept gathered for the step (pp > 1)
        assert r.grad_accum_bytes == 4 * sum(tp_local.values())  # fp32, over 4 microbatches


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_dry_run_activations_equal_a_real_forward(tmp_path, ac):
    cfg = job(tmp_path, TINY, 2, tp=1, mp="fp32", ac=ac)  # pp2 only: no FSDP or TP, real and fake runs comparable
    planned = plan_job(cfg, 2)
    model = build_model(cfg.model, "cpu")
    layout = layout_for(model)
    mb, seq = planned.microbatch, cfg.training.seq_len
    for spec in plan_stages(model, layout, cfg.parallel, seq).stages:
        stage = StageModule(model, layout, spec)
        apply_activation_checkpoint(stage, None, cfg.parallel)
        x = torch.zeros(mb, seq, dtype=torch.long) if spec.embed else torch.randn(mb, seq, 64, requires_grad=True)
        with SavedActivations(stage) as saved:
            out = stage(x)
            if spec.head:
                TokenSumLoss()(out, torch.zeros(mb, seq, dtype=torch.long))
        assert planned.ranks[spec.rank].act_bytes_per_microbatch[spec.index] == saved.peak > 0


def test_schedule_table_holds_what_theory_says(tmp_path):
    planned = plan_job(job(tmp_path, TINY, 8, tp=2, mp="bf16"), 8)
    by_name = {s.name: s for s in planned.schedules}
    assert planned.schedules[0].name == "1F1B"  # the configured one first
    assert by_name["1F1B"].peak_microbatches == [2, 1]  # at most pp - rank in flight
    assert by_name["GPipe"].peak_microbatches == [4, 4]  # all m
    assert by_name["1F1B"].bubble_theory == by_name["1F1B"].bubble_simulated == pytest.approx(1 / 4)
    assert [r.act_peak_bytes for r in planned.ranks] == by_name["1F1B"].act_peak_bytes


def test_saved_activations_counts_storages_once_and_frees_them():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedActivations(lin) as saved:
        y = torch.relu(lin(x))  # saves x (weight grad) and y; the weight is a parameter, not counted
        loss = (y * y).sum()  # saves y twice: same storage
    assert saved.peak == saved.live == 2 * x.numel() * 4
    loss.backward()
    assert saved.live == 0 and saved.peak == 2 * x.numel() * 4


def test_peak_held_bytes_walks_the_action_order():
    gpipe, one_f_one_b = schedule_actions("GPipe", 4, 8), schedule_actions("1F1B", 4, 8)
    assert [peak_held_bytes(a, {r: 1}) for r, a in enumerate(gpipe)] == [8] * 4
    assert [peak_held_bytes(a, {r: 1}) for r, a in enumerate(one_f_one_b)] == [4, 3, 2, 1]


def test_405b_like_job_on_1024_ranks(tmp_path):
    planned = plan_job(job(tmp_path, LLAMA_405B_LIKE, 1024), 1024)
    assert planned.mesh == {"pp": 16, "dp_replicate": 1, "dp_shard": 8, "tp": 8}
    assert len(planned.plan.stages) == 32 and len(planned.ranks) == 16
    dim, kv, ffn = 16384, 1024, 53248
    matmul = 2 * dim * dim + 2 * dim * kv + 3 * dim * ffn
    middle = planned.ranks[1]  # stages 1 and 17: 8 blocks, matmuls over tp * dp = 64, norms over dp = 8
    assert middle.local_params == 8 * (matmul // 64 + 2 * dim // 8)
    assert middle.act_peak_bytes > 0 and planned.schedules[0].bubble_theory == pytest.approx(15 / 64)


def run_plan(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    """`pp-tp plan` in process: `python -m pp_tp.cli` itself is run as a user runs it in test_cli_check."""
    from pp_tp.cli.main import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_prints_stages_mesh_memory_and_schedules(tmp_path, capsys, monkeypatch):
    path = tmp_path / "job.toml"
    path.write_text(TINY.format(tp=2, mp="bf16", ac="none"))
    code, out, err = run_plan(
        capsys, monkeypatch, "--config", str(path), "--world-size", "8", "parallel.schedule=GPipe"
    )
    assert code == 0, err
    assert "mesh pp=2 x dp_replicate=1 x dp_shard=2 x tp=2" in out
    assert "cost (GFLOP/token)" in out and "optimizer" in out and "act peak" in out
    assert "GPipe *" in out and "Traceback" not in err


def test_cli_bad_world_size_is_one_error_line(tmp_path, capsys, monkeypatch):
    path = tmp_path / "job.toml"
    path.write_text(TINY.format(tp=2, mp="bf16", ac="none"))
    code, out, err = run_plan(capsys, monkeypatch, "--config", str(path), "--world-size", "6")
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: parallel.dp_shard = -1 cannot fill world size 6")


def test_cli_without_world_size_names_the_world_it_planned(tmp_path, capsys, monkeypatch):
    """No --world-size: the degrees' product, said first; dp_shard = -1 is taken as 1, and a refusal (a budget
    nothing fits) names that world and the flag that sets it."""
    path = tmp_path / "job.toml"
    path.write_text(TINY.format(tp=2, mp="bf16", ac="none"))
    code, out, err = run_plan(capsys, monkeypatch, "--config", str(path), "parallel.dp_shard=2")
    assert code == 0, err
    first = out.splitlines()[0]
    assert first.startswith("planned at world size 8 = pp 2 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 2"), first
    assert "product of the config's degrees" in first and "world: 8 ranks" in out
    code, out, err = run_plan(capsys, monkeypatch, "--config", str(path), "parallel.fsdp_reshard_after_forward=auto",
                              "parallel.memory_budget_gib=0.0001")  # fmt: skip
    assert code == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith("error: parallel.memory_budget_gib = 0.0001: no FSDP policy fits pp rank 0;"), line
    assert line.endswith("(planned at world size 4 = pp 2 x dp_replicate 1 x dp_shard 1 x cp 1 x tp 2, the fewest "
                         "ranks the degrees allow (dp_shard = -1 taken as 1); pass --world-size N)"), line  # fmt: skip
