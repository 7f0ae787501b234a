"""The TOML flow with a Hugging Face model: `[model] hf_path` (weights loaded) + `[data] tokenizer`, validation,
DCP checkpoints, `pp-tp export` (in the 4-rank world, and as one process through the CLI), transformers loads
the result. Also the tokenizer's one-line errors and the shipped demo's files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import hf_utils as hu
import pytest
import torch
from train_utils import CORPUS, REPO, to_toml

from pp_tp.cli.job import check_job
from pp_tp.config import config_from_dict
from pp_tp.errors import ConfigError
from pp_tp.parity import mean_token_loss
from pp_tp.train.sources import make_source

TOKENIZER = os.path.join(REPO, "toml_configs", "hf_tiny")


def _job(tmp: str) -> dict:
    return {
        "model": {"hf_path": os.path.join(tmp, "hf")},
        "parallel": {"pp": 2, "dp_shard": 2, "schedule": "1F1B", "microbatches": 2, "mixed_precision": "fp32"},
        "training": {"steps": 3, "batch_size": 8, "seq_len": 16, "lr": 1e-3, "warmup_steps": 1, "comm_timeout_s": 60},
        "data": {"source": "text", "path": CORPUS, "tokenizer": TOKENIZER},
        "validation": {"every": 2, "steps": 2, "split": 0.05},
        "checkpoint": {"enable": True, "folder": os.path.join(tmp, "ckpt"), "interval": 0, "keep": 2},
    }


def train_export_case(d: dict, out: str) -> list[dict]:
    from pp_tp.cli.export import export
    from pp_tp.train.trainer import train

    cfg, _ = check_job(config_from_dict(d, world_size=4), 4)
    rows = train(cfg)
    export(cfg, out)  # at this world's size: pp4
    return rows


@pytest.fixture(scope="module")
def trained(world, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("hfjob"))
    config = hu.llama_config(vocab_size=512, max_position_embeddings=64)
    hu.llama(config).save_pretrained(os.path.join(tmp, "hf"))  # the initial weights the run must load
    d = _job(tmp)
    rows = world(4).run(train_export_case, d, os.path.join(tmp, "out4"))
    return tmp, d, rows


def test_hf_path_weights_and_tokenizer_train_with_validation(trained):
    tmp, d, rows = trained
    cfg, _ = check_job(config_from_dict(d, world_size=4), 4, data=False)  # shape keys from config.json
    ids, labels, _ = make_source(cfg).loader(0, 1).next()
    assert int(ids.max()) < 512 and int(ids.max()) > 255  # BPE ids, not bytes
    want = mean_token_loss(hu.from_pretrained(os.path.join(tmp, "hf")), ids, labels).item()
    for r in rows:  # every rank: step 1's loss is the pretrained weights' loss on the same batch
        assert abs(r[0]["loss"] - want) <= 1e-5 * want, (r[0], want)
        assert [("val_loss" in x) for x in r] == [False, True, True]
        assert [x["val_loss"] for x in r[1:]] == [x["val_loss"] for x in rows[0][1:]]  # the same on every rank
        assert 0 < r[-1]["val_loss"] < r[0]["loss"] + 1


def test_export_in_the_world_and_as_one_process_load_in_transformers(trained, tmp_path):
    tmp, d, _ = trained
    cfg_file = tmp_path / "job.toml"
    cfg_file.write_text(to_toml({**d, "parallel": {**d["parallel"]}}))
    out1 = tmp_path / "out1"
    result = subprocess.run(
        [sys.executable, "-m", "pp_tp.cli", "export", "--config", str(cfg_file), "--to", str(out1)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = hu.from_pretrained(os.path.join(tmp, "out4")), hu.from_pretrained(str(out1))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    start = hu.from_pretrained(os.path.join(tmp, "hf")).state_dict()
    assert any(not torch.equal(sa[k], start[k]) for k in sa)  # trained, not the initial weights
    assert json.load(open(out1 / "config.json"))["vocab_size"] == 512
    gen = a.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, 7)


def test_tokenizer_errors_are_one_line(tmp_path):
    base = {"data": {"source": "text", "path": CORPUS, "tokenizer": TOKENIZER}, "parallel": {"dp_shard": 1}}
    small = {**base, "model": {"vocab_size": 300}}
    with pytest.raises(ConfigError, match=r"has 512 tokens, more than model.vocab_size = 300"):
        make_source(config_from_dict(small, world_size=1))
    missing = {**base, "data": {**base["data"], "tokenizer": str(tmp_path)}}
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        make_source(config_from_dict(missing, world_size=1))


def test_eos_separates_documents_and_the_shipped_tokenizer_is_the_scripts_output(tmp_path):
    from pp_tp.train.text_tokens import encode_file, load_tokenizer

    text = tmp_path / "t.txt"
    text.write_text("after monday comes tuesday.\nsnow is white.\n")
    ids = encode_file(str(text), TOKENIZER, 512).tolist()
    assert ids.count(0) == 2 and ids[-1] == 0  # <|endoftext|> after each document
    assert load_tokenizer(TOKENIZER).decode(ids[: ids.index(0)]) == "after monday comes tuesday."
    subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "train_tokenizer.py"), CORPUS, str(tmp_path / "tk")], check=True
    )
    assert (tmp_path / "tk" / "tokenizer.json").read_bytes() == open(
        os.path.join(TOKENIZER, "tokenizer.json"), "rb"
    ).read()
