"""Verdicts on disk (pp_tp/base/disk_memo.py): processes asking together compute once; any change of what the value
depends on computes afresh; a damaged entry, an unwritable folder or PP_TP_CACHE_DIR="" only cost the computation;
a Hugging Face family's self-check and randomness verdicts come from disk in a process that never ran them."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from pp_tp.base import disk_memo as dm
from pp_tp.errors import ConfigError


def _slow_count(folder: str, log: str, parts: list) -> str:
    os.environ[dm.ENV] = folder

    def compute() -> str:
        with open(log, "a") as f:
            f.write("computed\n")
        time.sleep(0.5)  # long enough for the other processes to find the entry missing and wait on its lock
        return "verdict"

    return dm.disk_memo(parts, compute)


def test_processes_asking_together_compute_once(tmp_path):
    log = str(tmp_path / "log")
    with mp.get_context("fork").Pool(3) as pool:  # the children only read, write and sleep
        out = pool.starmap(_slow_count, [(str(tmp_path / "c"), log, ["a", 1])] * 3)
    assert out == ["verdict"] * 3
    assert Path(log).read_text().splitlines() == ["computed"]


def test_a_change_of_any_part_computes_afresh_and_nothing_else_does(tmp_path, monkeypatch):
    monkeypatch.setenv(dm.ENV, str(tmp_path))
    calls = []

    def compute(v):
        return lambda: calls.append(v) or {"keys": {"x": v}}

    assert dm.disk_memo(["cls", "small", 1], compute(1)) == {"keys": {"x": 1}}
    assert dm.disk_memo(["cls", "small", 1], compute(9)) == {"keys": {"x": 1}}  # read back, not computed
    assert dm.disk_memo(["cls", "small", 2], compute(2)) == {"keys": {"x": 2}}
    assert calls == [1, 2]
    monkeypatch.setattr(dm, "_package_digest", lambda: "pp_tp edited")  # pp_tp's own code changed
    assert dm.disk_memo(["cls", "small", 1], compute(3)) == {"keys": {"x": 3}}
    assert calls == [1, 2, 3]


def test_damaged_unwritable_or_switched_off_only_cost_the_computation(tmp_path, monkeypatch):
    monkeypatch.setenv(dm.ENV, str(tmp_path))
    assert dm.disk_memo(["p"], lambda: None) is None
    (entry,) = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
    assert json.loads(entry.read_text()) == {"value": None}
    entry.write_text("{trunc")
    assert dm.disk_memo(["p"], lambda: "again") == "again"
    assert json.loads(entry.read_text()) == {"value": "again"}  # rewritten whole
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv(dm.ENV, str(blocked / "sub"))  # a folder that cannot be made
    assert dm.disk_memo(["p"], lambda: "computed") == "computed"
    monkeypatch.setenv(dm.ENV, "")
    assert dm.cache_dir() is None
    assert [dm.disk_memo(["p"], lambda i=i: i) for i in range(2)] == [0, 1]


def test_a_family_verdicts_come_from_disk_in_a_process_that_never_ran_them(tmp_path, monkeypatch):
    """The self-check and the randomness verdict of a tiny Llama are written once; with the in-memory records
    dropped (a new process) and both computations made to fail, the layout still comes out, read from disk."""
    transformers = pytest.importorskip("transformers")
    from pp_tp.models.hf import randomness, record, self_check
    from pp_tp.models.hf.layout import specialize

    monkeypatch.setenv(dm.ENV, str(tmp_path))
    monkeypatch.setattr(record, "_RECORDS", {})
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    first = specialize(model)
    assert len(list(tmp_path.glob("*.json"))) == 2  # the self-check's verdict and the noise verdict

    def fail(*_):
        raise AssertionError("computed again")

    monkeypatch.setattr(record, "_RECORDS", {})
    monkeypatch.setattr(self_check, "_verdict", fail)
    monkeypatch.setattr(randomness, "_verdict", fail)
    assert specialize(model).blocks == first.blocks
    monkeypatch.setenv(dm.ENV, str(tmp_path / "elsewhere"))  # without the entries, it is computed (and fails)
    monkeypatch.setattr(record, "_RECORDS", {})
    with pytest.raises(ConfigError, match="computed again"):  # the self-check refuses a copy it cannot run
        specialize(model)
