"""`data.source = "dataset"` paths as users write them: a folder (the files `datasets` takes from a directory), kinds
mixed within a folder and across `data.paths`, and the one-line refusals of `pp-tp check` and `pp-tp train`.
Real files in tmp_path read through the real `datasets`; the assertions are on the token ids read."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch
from test_data_sources import TOKENIZER, _dataset_job, _docs, _read
from train_utils import to_toml

from pp_tp.cli import launch
from pp_tp.cli.main import main
from pp_tp.config import config_from_dict
from pp_tp.train.sources import make_source


def _jsonl(path, docs: list[str]) -> str:
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(docs)))
    return str(path)


def _parquet(path, docs: list[str]) -> str:
    import datasets

    datasets.Dataset.from_dict({"text": docs}).to_parquet(str(path))
    return str(path)


def _arrow(path, docs: list[str]) -> str:
    """An Arrow IPC stream, as `save_to_disk` writes its shards."""
    table = pa.table({"text": docs})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return str(path)


def _saved(path, docs: list[str]) -> str:
    import datasets

    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(path))
    return str(path)


def _documents(d: dict) -> list[list[int]]:
    """Every document's token ids, in the order the source reads them."""
    docs = make_source(config_from_dict(d, world_size=4)).docs
    return [docs.tokens(i) for i in range(docs.num_docs)]


def _encoded(docs: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{TOKENIZER}/tokenizer.json")
    eos = tok.token_to_id("<|endoftext|>")
    return [tok.encode(t, add_special_tokens=False).ids + [eos] for t in docs]


def _paths_job(paths: list[str]) -> dict:
    d = _dataset_job("")
    d["data"].update(path="", paths=paths)
    return d


def test_a_folder_reads_its_data_files_of_every_kind_in_order(tmp_path):
    """Files in name order, as `datasets` lists a folder; README, hidden files and empty files hold no documents."""
    docs = _docs(40)
    f = tmp_path / "corpus"
    (f / "sub").mkdir(parents=True)
    _jsonl(f / "a.jsonl", docs[:10])
    _parquet(f / "b.parquet", docs[10:20])
    _arrow(f / "c.arrow", docs[20:25])
    _jsonl(f / "d.jsonl", docs[25:32])
    (f / "e.jsonl").write_text("")
    _jsonl(f / "sub" / "f.jsonl", docs[32:])
    (f / "README.md").write_text("# not data\n")
    (f / ".hidden.jsonl").write_text("not json\n")
    assert _documents(_dataset_job(str(f))) == _encoded(docs)
    # packed batches equal those of the same documents in one jsonl file
    one = _jsonl(tmp_path / "one.jsonl", docs)
    got, want = _read(_dataset_job(str(f)), 2, 3)[0], _read(_dataset_job(one), 1, 3)[0]
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_paths_mix_files_globs_folders_and_saved_datasets(tmp_path):
    docs = _docs(50, seed=1)
    (tmp_path / "f").mkdir()
    (tmp_path / "g").mkdir()
    _jsonl(tmp_path / "f" / "x.jsonl", docs[8:16])
    _arrow(tmp_path / "f" / "y.arrow", docs[16:20])
    _parquet(tmp_path / "g" / "p0.parquet", docs[20:26])
    _jsonl(tmp_path / "g" / "p1.jsonl", docs[26:30])
    paths = [
        _parquet(tmp_path / "a.parquet", docs[:8]),
        str(tmp_path / "f"),
        str(tmp_path / "g" / "p*"),
        _saved(tmp_path / "saved", docs[30:44]),
        _jsonl(tmp_path / "z.json", docs[44:]),
    ]
    assert _documents(_paths_job(paths)) == _encoded(docs)


def test_a_folder_with_split_names_trains_on_its_train_files(tmp_path):
    docs = _docs(20, seed=2)
    _jsonl(tmp_path / "train.jsonl", docs[:12])
    _parquet(tmp_path / "test.parquet", docs[12:])
    assert _documents(_dataset_job(str(tmp_path))) == _encoded(docs[:12])


def _refusal(tmp_path, capsys, d: dict, command: str = "check") -> str:
    """`pp-tp check` (or `pp-tp train --nproc 4`, which must refuse before spawning) on the job: its one line."""
    cfg = tmp_path / "job.toml"
    cfg.write_text(to_toml(d))
    extra = ["--world-size", "4"] if command == "check" else ["--nproc", "4"]
    assert main([command, "--config", str(cfg), *extra]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _bad_paths(tmp_path) -> dict[str, tuple[str, str]]:
    """Each refused case: (the entry as written, what the line says about it)."""
    (tmp_path / "nodata").mkdir()
    (tmp_path / "nodata" / "README.md").write_text("# only a readme\n")
    (tmp_path / "nodata" / "rows.csv").write_text("text\na b\n")
    (tmp_path / "tests_only").mkdir()
    _jsonl(tmp_path / "tests_only" / "test.jsonl", ["a b"])
    (tmp_path / "mixed").mkdir()
    _jsonl(tmp_path / "mixed" / "a.jsonl", ["a b"])
    (tmp_path / "mixed" / "b.txt").write_text("a b\n")
    (tmp_path / "rows.csv").write_text("text\na b\n")
    return {
        "missing": (str(tmp_path / "nope"), "matches no file"),
        "folder without data files": (str(tmp_path / "nodata"), "is a folder with no .jsonl / .json, .parquet or"),
        "folder of another split": (str(tmp_path / "tests_only"), "give the splits ['test'] but no train split"),
        "unknown extension": (str(tmp_path / "rows.csv"), 'is a .csv file; data.source = "dataset" reads'),
        "glob matching another kind": (str(tmp_path / "mixed" / "*"), "b.txt', which is a .txt file"),
    }


BAD = (
    "missing",
    "folder without data files",
    "folder of another split",
    "unknown extension",
    "glob matching another kind",
)


@pytest.mark.parametrize("case", BAD)
def test_bad_paths_are_one_line_naming_the_path_once(tmp_path, capsys, monkeypatch, case):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    entry, says = _bad_paths(tmp_path)[case]
    ok = _jsonl(tmp_path / "ok.jsonl", ["a b c"])
    line = _refusal(tmp_path, capsys, _paths_job([ok, entry]))
    assert says in line and line.count(f"'{entry}'") == 1, line
    assert line.startswith("error: data.paths[1] = "), line
    if case == "unknown extension":  # `pp-tp train` refuses the same line before any rank starts
        monkeypatch.setattr(launch, "run_under_torchrun", lambda *a: pytest.fail("a rank was started"))
        assert _refusal(tmp_path, capsys, _paths_job([ok, entry]), "train") == line
