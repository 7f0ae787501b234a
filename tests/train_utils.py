"""Shared pieces of the trainer, checkpoint and fault tests: a tiny byte-level job and running it."""

from __future__ import annotations

import copy
import json
import os

import pp_tp

CORPUS = os.path.join(os.path.dirname(pp_tp.__file__), "data", "patterns.txt")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 6 steps of a 4-layer byte-level model on the shipped text; small enough for 2 shared cores.
TINY_JOB = {
    "model": {
        "vocab_size": 256,
        "dim": 32,
        "n_layers": 4,
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn_dim": 64,
        "max_seq_len": 64,
    },
    "parallel": {"pp": 2, "tp": 2, "dp_shard": 1, "schedule": "1F1B", "microbatches": 4, "mixed_precision": "fp32"},
    "training": {
        "steps": 6,
        "batch_size": 16,
        "seq_len": 32,
        "lr": 3e-3,
        "warmup_steps": 2,
        "log_every": 1,
        "comm_timeout_s": 60,
    },
    "data": {"source": "text", "path": CORPUS},
    "checkpoint": {"enable": False, "interval": 3, "keep": 2},
}


def job(**sections: dict) -> dict:
    """TINY_JOB with some keys replaced, e.g. job(parallel={"pp": 4, "tp": 1})."""
    d = copy.deepcopy(TINY_JOB)
    for name, values in sections.items():
        d[name].update(values)
    return d


def to_toml(d: dict) -> str:
    """The job as TOML text, for the tests that start real processes."""
    from pp_tp.config import ParallelConfig, config_from_dict, format_config

    return format_config(config_from_dict(d, world_size=ParallelConfig(**d["parallel"]).world_size))


def train_case(d: dict) -> list[dict]:
    """A harness case: runs the job on this world's ranks; every rank returns its metrics rows."""
    from pp_tp.config import config_from_dict
    from pp_tp.train.trainer import train

    return [{k: r[k] for k in ("step", "loss", "grad_norm", "lr")} for r in train(config_from_dict(d))]


# The restart tests' job (test_faults, test_checkpoint_async): pp2 on 2 ranks, 5 steps, a checkpoint every 2.
RESTART_JOB = job(parallel={"pp": 2, "tp": 1}, training={"steps": 5}, checkpoint={"interval": 2})
_uninterrupted: list[list[dict]] = []


def uninterrupted(world) -> list[dict]:
    """RESTART_JOB's rows on rank 0 without checkpoints (which change no number), run once for both restart tests."""
    if not _uninterrupted:
        _uninterrupted.append(world(2).run(train_case, RESTART_JOB)[0])
    return _uninterrupted[0]


def last_per_step(path: str) -> dict[int, dict]:
    """A metrics JSONL file's step rows by step, the last one of each (a restarted attempt rewrites the steps it
    repeats); the layout row is an event, left out."""
    rows = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "event" not in row:
                rows[row["step"]] = row
    return rows
