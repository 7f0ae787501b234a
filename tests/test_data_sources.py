"""`data.source = "tokens"` and `"dataset"`: what a DP rank reads equals its share of a one-process reading of the
same global order, the order resumes from the saved state, a mixture draws by its weights, a rank's memory does not
grow with the corpus, and every bad input is one line before any process group."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pyarrow as pa
import pytest
import torch
from train_utils import REPO, job

from pp_tp.cli.job import check_job
from pp_tp.config import config_from_dict
from pp_tp.errors import ConfigError
from pp_tp.train.shuffle import permuted
from pp_tp.train.sources import make_source

TOKENIZER = f"{REPO}/toml_configs/hf_tiny"  # 512 tokens, EOS <|endoftext|>
WORDS = "alpha beta gamma delta river stone cloud seven apple tiger".split()


def _tokens_job(paths, **data) -> dict:
    return job(
        model={"vocab_size": 512, "max_seq_len": 64},
        parallel={"pp": 2, "tp": 1, "dp_shard": 2},
        data={"source": "tokens", "path": "", "paths": paths, **data},
    )


def _docs(n: int, seed: int = 0) -> list[str]:
    gen = np.random.default_rng(seed)
    return [" ".join(gen.choice(WORDS, size=int(gen.integers(3, 12)))) for _ in range(n)]


def _dataset_job(path: str, **data) -> dict:
    return job(
        model={"vocab_size": 512, "max_seq_len": 64},
        parallel={"pp": 2, "tp": 1, "dp_shard": 2},
        data={"source": "dataset", "path": path, "tokenizer": TOKENIZER, **data},
    )


def _write_bin(path, ids, dtype=np.uint16) -> str:
    np.asarray(ids, dtype=dtype).tofile(path)
    return str(path)


def _read(d: dict, dp_size: int, steps: int, state: dict | None = None) -> tuple[list[torch.Tensor], list]:
    """Global batches assembled from `dp_size` loaders (one per DP rank), and the state after them."""
    data = make_source(config_from_dict(d, world_size=4))
    loaders = [data.loader(r, dp_size) for r in range(dp_size)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    out = []
    for _ in range(steps):
        parts = [loader.next() for loader in loaders]
        for p in parts:
            assert torch.equal(p.input_ids[:, 1:], p.labels[:, :-1])
        out.append(torch.cat([p.input_ids for p in parts]))
        positions = [p.position_ids for p in parts]
    state = loaders[0].state_dict()
    if "cursors" in state:  # without a process group each loader's state holds its own rows only (zeros elsewhere)
        state = {"cursors": sum(loader.state_dict()["cursors"] for loader in loaders)}
    return out, [state, positions]


def test_token_files_dp_shares_are_the_one_process_order_and_resume(tmp_path):
    gen = torch.Generator().manual_seed(0)
    a = _write_bin(tmp_path / "a.bin", torch.randint(0, 512, (5000,), generator=gen))
    np.save(tmp_path / "b.npy", torch.randint(0, 512, (3000,), generator=gen).numpy().astype(np.uint32))
    d = _tokens_job([a, str(tmp_path / "b.npy")], weights=[3.0, 1.0])
    one, _ = _read(d, 1, 6)
    two, (state, _) = _read(d, 2, 3)
    assert all(torch.equal(x, y) for x, y in zip(one, two))
    rows = [tuple(r.tolist()) for b in one for r in b]
    assert len(set(rows)) == len(rows)  # 96 windows of 156 + 93: none twice within the epoch
    # each window is a contiguous slice of one of the files
    flat = {0: np.fromfile(a, dtype=np.uint16).tolist(), 1: np.load(tmp_path / "b.npy").tolist()}
    origin = [next(f for f, toks in flat.items() if _contains(toks, list(r))) for r in rows]
    assert 0.6 < origin.count(0) / len(origin) < 0.9  # drawn 3:1
    resumed, _ = _read(d, 2, 3, state)
    assert all(torch.equal(x, y) for x, y in zip(one[3:], resumed))
    other_seed, _ = _read(job(**{**d, "training": {**d["training"], "seed": 1}}), 1, 1)
    assert not torch.equal(other_seed[0], one[0])


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def _write_corpus(tmp_path, docs: list[str]) -> dict[str, str]:
    """The same documents as jsonl, parquet and a saved `datasets` directory."""
    import datasets

    (tmp_path / "j").mkdir()
    half = len(docs) // 2
    for i, part in enumerate((docs[:half], docs[half:])):
        with open(tmp_path / "j" / f"part{i}.jsonl", "w") as f:
            f.writelines(json.dumps({"id": k, "text": t}) + "\n" for k, t in enumerate(part))
    table = datasets.Dataset.from_dict({"text": docs})
    table.to_parquet(str(tmp_path / "c.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    return {
        "jsonl": str(tmp_path / "j" / "*.jsonl"),
        "parquet": str(tmp_path / "c.parquet"),
        "saved": str(tmp_path / "saved"),
    }


def test_dataset_rows_pack_their_documents_in_the_global_order_and_resume_at_another_dp(tmp_path):
    from tokenizers import Tokenizer

    docs = _docs(60)
    paths = _write_corpus(tmp_path, docs)
    d = _dataset_job(paths["jsonl"], document_mask=True)
    one, (_, pos) = _read(d, 1, 4)
    for kind in ("parquet", "saved"):
        assert all(torch.equal(x, y) for x, y in zip(one, _read(_dataset_job(paths[kind]), 1, 4)[0]))
    two, (state, _) = _read(d, 2, 2)
    assert all(torch.equal(x, y) for x, y in zip(one, two))
    resumed, _ = _read(d, 4, 2, state)  # a resume at dp = 4 continues every row
    assert all(torch.equal(x, y) for x, y in zip(one[2:], resumed))
    # row j is the documents at j, j + B, j + 2B, ... of the epoch's shuffled order, EOS-ended, end to end
    tok = Tokenizer.from_file(f"{TOKENIZER}/tokenizer.json")
    eos = tok.token_to_id("<|endoftext|>")
    for j in (0, 5):
        order = [docs[permuted(i, 60, f"0:{e}")] for e in range(3) for i in range(j, 60, 16)]  # epochs 0..2
        want = [t for doc in order for t in tok.encode(doc, add_special_tokens=False).ids + [eos]]
        assert [t for b in one for t in b[j].tolist()] == want[: 4 * 32]
    ids = one[-1][: pos[0].shape[0]]
    assert (pos[0][:, 1:][ids[:, :-1] == eos] == 0).all() and (pos[0][:, 1:][ids[:, :-1] != eos] > 0).all()


def _memory(d: dict, steps: int) -> int:
    """Peak bytes Python, numpy and Arrow allocate while the source opens (a dataset's Arrow cache already written,
    as `pp-tp check` leaves it) and a rank reads `steps` batches."""
    tracemalloc.start()
    arrow = pa.total_allocated_bytes()
    loader = make_source(config_from_dict(d, world_size=4)).loader(1, 2)
    for _ in range(steps):
        loader.next()
    peak = tracemalloc.get_traced_memory()[1] + pa.total_allocated_bytes() - arrow
    tracemalloc.stop()
    return peak


def test_memory_of_a_rank_does_not_grow_with_the_corpus(tmp_path):
    import datasets

    gen = np.random.default_rng(0)
    small = _write_bin(tmp_path / "small.bin", gen.integers(0, 512, 2_000_000, dtype=np.uint16))  # 4 MB
    big = _write_bin(tmp_path / "big.bin", gen.integers(0, 512, 20_000_000, dtype=np.uint16))  # 40 MB
    m_small, m_big = (_memory(_tokens_job([p]), 5) for p in (small, big))
    assert m_big < 1.5 * m_small + 200_000 < 10_000_000, (m_small, m_big)  # chunks of the id check, not the file
    for n in (2_000, 20_000):
        datasets.Dataset.from_dict({"text": _docs(n)}).to_parquet(str(tmp_path / f"d{n}.parquet"))
        make_source(config_from_dict(_dataset_job(str(tmp_path / f"d{n}.parquet")), world_size=4))  # `pp-tp check`
    d_small, d_big = (_memory(_dataset_job(str(tmp_path / f"d{n}.parquet")), 5) for n in (2_000, 20_000))
    assert d_big < 1.5 * d_small + 200_000, (d_small, d_big)


BAD = [
    ("missing", {"path": "nothing/*.bin"}, "data.path = 'nothing/\\*.bin' matches no file"),
    ("odd size", {}, "not a multiple of data.dtype = 'uint32'"),
    ("big id", {}, "holds token id 600 >= model.vocab_size = 512"),
    ("empty", {}, "has no file with training.seq_len \\+ 1 = 33 tokens"),
    ("no text field", {"text_field": "body"}, "data.text_field = 'body' is not a column"),
    ("empty dataset", {}, "holds no documents"),
    ("tokenizer too big", {}, "has 512 tokens, more than model.vocab_size = 300"),
    ("mask without eos", {"document_mask": True}, "data.document_mask = true splits documents at the EOS token"),
    ("weights", {"weights": [1.0, 2.0]}, "data.weights = \\[1.0, 2.0\\] must give one positive weight per"),
    ("path and paths", {"path": "x.bin"}, "give exactly one of the two"),
    ("dataset without tokenizer", {"tokenizer": ""}, 'data.source = "dataset" tokenizes text: set data.tokenizer'),
    ("eos on a dataset", {"eos_id": 2}, 'data.eos_id is for data.source = "tokens"'),
]


@pytest.mark.parametrize("case, data, fragment", BAD, ids=[b[0] for b in BAD])
def test_bad_data_is_one_line_from_pp_tp_check(tmp_path, case, data, fragment):
    (tmp_path / "e.jsonl").write_text("")
    (tmp_path / "r.jsonl").write_text(json.dumps({"text": "a b c"}) + "\n")
    path = {
        "odd size": _write_bin(tmp_path / "o.bin", [1, 2, 3], np.uint16),
        "big id": _write_bin(tmp_path / "b.bin", [1, 600] * 40),
        "empty": _write_bin(tmp_path / "e.bin", [1] * 20),
    }.get(case, _write_bin(tmp_path / "ok.bin", [1] * 400))
    if case in ("no text field", "empty dataset", "tokenizer too big", "dataset without tokenizer", "eos on a dataset"):
        d = _dataset_job(str(tmp_path / ("e.jsonl" if case == "empty dataset" else "r.jsonl")), **data)
        if case == "tokenizer too big":
            d["model"]["vocab_size"] = 300
    else:
        d = _tokens_job([path], **({"dtype": "uint32"} if case == "odd size" else {}), **data)
        if case == "missing":
            d["data"]["paths"] = None
    with pytest.raises(ConfigError, match=fragment) as e:
        check_job(config_from_dict(d, world_size=4), world_size=4)
    assert "\n" not in str(e.value)


def test_shipped_corpus_is_the_generator_output():
    import glob
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_corpus", f"{REPO}/tools/make_corpus.py")
    make_corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_corpus)
    files = sorted(glob.glob(f"{REPO}/examples/corpus/*.jsonl"))
    assert [open(f).readlines() for f in files] == make_corpus.shard_rows(1200, 2)
