"""A damaged `model.hf_path`: a truncated, header-corrupt or missing safetensors file is one `error:` line naming the
file, from `pp-tp check` and from `pp-tp train` before any rank is spawned, and from `open_checked` (what
`build_pipeline` runs on every rank before its one collective)."""

from __future__ import annotations

import json
import os

import hf_utils as hu
import pytest
from train_utils import to_toml

from pp_tp.cli import launch
from pp_tp.cli.main import main
from pp_tp.errors import ConfigError
from pp_tp.hf_checkpoint import open_checked


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf") / "hf")
    hu.llama(hu.llama_config()).save_pretrained(path)
    return path


def _damaged(tmp_path, hf_dir: str, how: str) -> tuple[str, str]:
    """A copy of `hf_dir` damaged `how`; (its path, the file named in the line)."""
    out = tmp_path / "damaged"
    out.mkdir()
    for name in os.listdir(hf_dir):
        (out / name).write_bytes(open(os.path.join(hf_dir, name), "rb").read())
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    if how == "truncated":
        weights.write_bytes(data[: len(data) - 1000])
    elif how == "corrupt header":
        weights.write_bytes(data[:8] + b"\x00" * 16 + data[24:])
    else:  # an index naming a shard that is not there
        keys = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        index = {"weight_map": {k: "model-00001-of-00002.safetensors" for k in keys if k != "__metadata__"}}
        weights.unlink()
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
        return str(out), "model-00001-of-00002.safetensors"
    return str(out), str(weights)


@pytest.mark.parametrize("how", ["truncated", "corrupt header", "missing"])
def test_damaged_safetensors_is_one_line_from_check_train_and_the_build(tmp_path, hf_dir, how, monkeypatch, capsys):
    path, named = _damaged(tmp_path, hf_dir, how)
    with pytest.raises(ConfigError) as e:
        open_checked(path, hu.llama(hu.llama_config(), "meta"))
    assert named in str(e.value) and "\n" not in str(e.value)
    job = tmp_path / "job.toml"
    parallel = {"pp": 2, "microbatches": 2, "mixed_precision": "fp32"}
    job.write_text(to_toml({"model": {"hf_path": path}, "parallel": parallel, "training": {"seq_len": 16}}))
    monkeypatch.setattr(launch, "run_under_torchrun", lambda *a: (_ for _ in ()).throw(AssertionError("spawned")))
    for argv in (["check", "--config", str(job), "--world-size", "2"], ["train", "--config", str(job), "--nproc", "2"]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        (line,) = err.splitlines()
        assert line == f"error: {e.value}" and "Traceback" not in out + err
    if how == "truncated":
        assert "bytes; its header describes" in line and "truncated?" in line
