"""The trainer: LR schedule, data sharding, the shipped corpus, a 4-rank `pp-tp train` from TOML, and faults."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from train_utils import CORPUS, REPO, job, to_toml, train_case

from pp_tp.config import config_from_dict
from pp_tp.errors import ConfigError
from pp_tp.train.data import ShardedBatches, SyntheticSource, TextSource, corpus_text, make_source
from pp_tp.train.trainer import lr_factor

KILL_ENTRY = os.path.join(os.path.dirname(__file__), "kill_entry.py")


def test_lr_warms_up_linearly_then_decays_by_cosine_to_min_ratio():
    f = [lr_factor(s, warmup=4, total=12, min_ratio=0.1) for s in range(13)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == 1.0 and f[8] == pytest.approx(0.55) and f[12] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(f[4:]))


def test_mfu_uses_the_device_table_and_is_left_out_when_the_peak_is_unknown():
    from pp_tp.train.metrics import MetricsLogger, peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and peak_flops("cpu") is None
    row = MetricsLogger("", 1, False, 1e9, 2, 1e12).log(3, False, 2.0, 0.5, 1e-3, tokens=1000, step_time_s=0.5)
    assert row["tokens_per_s"] == 2000 and row["mfu"] == pytest.approx(1.0)  # 1e9 * 2000 / (2 * 1e12)
    assert "mfu" not in MetricsLogger("", 1, False, 1e9, 2, None).log(3, False, 2.0, 0.5, 1e-3, 1000, 0.5)


def _rows(batches: ShardedBatches, steps: int) -> list[bytes]:
    out = []
    for _ in range(steps):
        ids, labels = batches.next()
        assert torch.equal(ids[:, 1:], labels[:, :-1])
        out += [bytes(r.tolist()) for r in ids]
    return out


def test_dp_shards_see_each_sample_once_per_epoch_and_the_global_batch_is_layout_free(tmp_path):
    path = tmp_path / "t.txt"
    gen = torch.Generator().manual_seed(0)
    path.write_bytes(bytes(torch.randint(0, 256, (1024,), generator=gen).tolist()))  # 63 windows of 16 (+1 label)
    src = TextSource(str(path), 16)
    assert src.num_samples == 63
    one = ShardedBatches(src, 8, 0, 1, seed=5)
    halves = [ShardedBatches(src, 8, r, 2, seed=5) for r in range(2)]
    steps = 7  # 56 of the 63 samples
    whole = _rows(one, steps)
    assert len(set(whole)) == 56  # no sample twice within the epoch
    per_rank = [_rows(h, steps) for h in halves]
    assert set(per_rank[0]).isdisjoint(per_rank[1])
    # dp=2 splits each global batch of the dp=1 run into its two halves, in order
    assert [row for k in range(steps) for h in per_rank for row in h[4 * k : 4 * k + 4]] == whole


def test_position_resumes_the_same_order_and_the_seed_changes_it(tmp_path):
    src = TextSource(CORPUS, 32)
    a = ShardedBatches(src, 4, 1, 2, seed=0)
    _rows(a, 3)
    b = ShardedBatches(src, 4, 1, 2, seed=0)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == {"position": 12}
    assert _rows(a, 2) == _rows(b, 2)
    assert _rows(ShardedBatches(src, 4, 1, 2, seed=1), 1) != _rows(ShardedBatches(src, 4, 1, 2, seed=0), 1)


def test_shipped_corpus_is_the_generator_output_and_synthetic_samples_are_english():
    with open(CORPUS) as f:
        assert f.read() == corpus_text(0, 200_000)
    text = bytes(SyntheticSource(3, 200).sample(7).tolist()).decode()
    assert len(text) == 201 and text[0].isupper() and ". " in text


@pytest.mark.parametrize(
    "sections, fragment",
    [
        ({"model": {"vocab_size": 128, "dim": 32}}, "model.vocab_size = 128"),
        ({"training": {"seq_len": 63}, "model": {"max_seq_len": 64}}, None),
    ],
)
def test_source_checks_run_before_any_process_group(tmp_path, sections, fragment):
    short = tmp_path / "short.txt"
    short.write_text("x" * 40)
    d = job(data={"path": str(short)}, **sections)
    with pytest.raises(ConfigError, match=fragment or r"data.path = .* has 40 bytes"):
        make_source(config_from_dict(d, world_size=4))


def _last_per_step(path: str) -> dict[int, dict]:
    rows = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "event" not in row:  # step rows; the layout row is an event
                rows[row["step"]] = row  # a restarted attempt rewrites the steps it repeats
    return rows


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
    rows = _last_per_step(str(metrics))
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
    d = job(parallel={"pp": 2, "tp": 1}, training={"steps": 5}, checkpoint={"interval": 2})
    baseline = world(2).run(train_case, d)[0]
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
    rows = _last_per_step(d["training"]["metrics_file"])
    assert sorted(rows) == [1, 2, 3, 4, 5]
    for base in baseline:
        assert rows[base["step"]]["loss"] == pytest.approx(base["loss"], rel=1e-6, abs=0)
        assert rows[base["step"]]["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-6, abs=0)
    assert math.isfinite(rows[5]["loss"]) and rows[5]["loss"] < rows[1]["loss"]


def foreach_case() -> dict:
    """TP without FSDP leaves the norms plain beside DTensor weights, a mix torch's foreach kernels refuse: the
    trainer's AdamW steps such a part with foreach per kind of tensor, and lands where per-tensor AdamW lands."""
    import parity_utils as pu

    import pp_tp
    from pp_tp.config import TrainingConfig
    from pp_tp.train.trainer import build_optimizers

    pcfg = pu.pcfg_of(tp=2)
    t = TrainingConfig()
    params, lr = {}, None
    for kind in ("trainer", "per_tensor"):
        pipe = pp_tp.build_pipeline(pu.make_model(device="meta"), pu.mesh_for(pcfg), pcfg)
        if kind == "trainer":
            optimizers, _ = build_optimizers(pipe.model_parts, t)
            lr = optimizers[0].param_groups[0]["lr"]  # the LR schedule's first value (warm-up)
        else:
            optimizers = [
                torch.optim.AdamW(part.parameters(), lr=lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
                for part in pipe.model_parts
            ]
        for _ in range(2):
            pipe.step(*pu.batch(pu.TINY, 4, 8))
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
        params[kind] = {k: pu.full_tensor(p).detach() for part in pipe.model_parts for k, p in part.named_parameters()}
        if kind == "trainer":
            groups = [(opt.defaults["foreach"], len(opt.param_groups)) for opt in optimizers]
    err = max(pu.rel_err(params["trainer"][k], params["per_tensor"][k]) for k in params["per_tensor"])
    return {"groups": groups, "err": err}


def test_optimizers_step_parts_mixing_dtensors_and_plain_tensors_with_foreach(world):
    for r in world(2).run(foreach_case):
        assert r["groups"] == [(True, 2)]  # DTensor weights and plain norms, one group each
        assert r["err"] < 1e-6
