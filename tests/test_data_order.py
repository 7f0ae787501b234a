"""Training data: DP shards of a layout-free global batch, a resumable seeded order, the shipped corpus, and the
source's checks before any process group."""

from __future__ import annotations

import pytest
import torch
from train_utils import CORPUS, job

from pp_tp.config import config_from_dict
from pp_tp.errors import ConfigError
from pp_tp.train.data import SyntheticSource, TextSource, corpus_text
from pp_tp.train.loader import ShardedBatches
from pp_tp.train.sources import make_source


def _rows(batches: ShardedBatches, steps: int) -> list[bytes]:
    out = []
    for _ in range(steps):
        ids, labels, _ = batches.next()
        assert torch.equal(ids[:, 1:], labels[:, :-1])
        out += [bytes(r.tolist()) for r in ids]
    return out


def test_dp_shards_see_each_sample_once_per_epoch_and_the_global_batch_is_layout_free(tmp_path):
    path = tmp_path / "t.txt"
    gen = torch.Generator().manual_seed(0)
    path.write_bytes(bytes(torch.randint(0, 256, (1024,), generator=gen).tolist()))  # 63 windows of 16 (+1 label)
    src = TextSource(str(path), 16)
    assert src.num_samples == 63
    one = ShardedBatches([src], 8, 0, 1, seed=5)
    halves = [ShardedBatches([src], 8, r, 2, seed=5) for r in range(2)]
    steps = 7  # 56 of the 63 samples
    whole = _rows(one, steps)
    assert len(set(whole)) == 56  # no sample twice within the epoch
    per_rank = [_rows(h, steps) for h in halves]
    assert set(per_rank[0]).isdisjoint(per_rank[1])
    # dp=2 splits each global batch of the dp=1 run into its two halves, in order
    assert [row for k in range(steps) for h in per_rank for row in h[4 * k : 4 * k + 4]] == whole


def test_position_resumes_the_same_order_and_the_seed_changes_it(tmp_path):
    src = TextSource(CORPUS, 32)
    a = ShardedBatches([src], 4, 1, 2, seed=0)
    _rows(a, 3)
    b = ShardedBatches([src], 4, 1, 2, seed=0)
    b.load_state_dict(a.state_dict())
    assert b.state_dict()["position"] == 12
    assert _rows(a, 2) == _rows(b, 2)
    assert _rows(ShardedBatches([src], 4, 1, 2, seed=1), 1) != _rows(ShardedBatches([src], 4, 1, 2, seed=0), 1)


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
