"""Real data through the trainer on 4 gloo ranks: what the ranks train on (token ids, read from the loader each rank
hands to `Pipeline.step`) is the one-process reading of the same global order, for token files (a mixture) and for a
dataset packed with document masks at pp2 x dp2; and a run resumed from its checkpoint at pp2 x tp2 sees exactly the
token ids the uninterrupted run saw."""

from __future__ import annotations

import os
import shutil

import numpy as np
import torch
from test_data_sources import TOKENIZER, _docs, _write_bin
from train_utils import job

from pp_tp.config import config_from_dict
from pp_tp.train.sources import make_source

PP2_DP2 = {"pp": 2, "tp": 1, "dp_shard": 2, "microbatches": 2}
PP2_TP2 = {"pp": 2, "tp": 2, "dp_shard": 1, "microbatches": 2, "embedding": "replicate"}


def ids_case(d: dict) -> list[tuple[int, int, list]]:
    """A harness case: trains the job; returns (step, dp rank, input ids) for every batch this rank stepped on."""
    from pp_tp.parallel.mesh import dp_rank
    from pp_tp.train.trainer import Trainer

    trainer = Trainer(config_from_dict(d))
    seen, take = [], trainer.loader.next

    def next_batch():
        batch = take()
        seen.append((trainer.step, dp_rank(trainer.mesh), batch.input_ids.tolist()))
        return batch

    trainer.loader.next = next_batch
    trainer.run()
    return seen


def _global(results: list, dp: int) -> dict[int, torch.Tensor]:
    """step -> the global batch's ids, from the ranks' shares (every rank of a DP index must agree)."""
    shares: dict[tuple[int, int], list] = {}
    for rank_rows in results:
        for step, r, ids in rank_rows:
            assert shares.setdefault((step, r), ids) == ids
    return {s: torch.tensor([row for r in range(dp) for row in shares[(s, r)]]) for s in sorted({s for s, _ in shares})}


def _one_process(d: dict, steps: int) -> list[torch.Tensor]:
    loader = make_source(config_from_dict(d, world_size=4)).loader(0, 1)
    return [loader.next().input_ids for _ in range(steps)]


def _job(steps: int, **data) -> dict:
    """A pp2 x dp2 job of the reference model at the tokenizer's vocabulary, packing documents with masks."""
    model = {"vocab_size": 512, "max_seq_len": 64}
    return job(model=model, parallel=PP2_DP2, training={"steps": steps}, data={**data, "document_mask": True})


def test_token_mixture_and_packed_dataset_train_on_the_global_order_and_resume_at_another_layout(tmp_path, world):
    gen = torch.Generator().manual_seed(0)
    files = [
        _write_bin(tmp_path / f"t{i}.bin", torch.randint(0, 512, (3000 + 2000 * i,), generator=gen)) for i in (0, 1)
    ]
    tokens = _job(2, source="tokens", path="", paths=files, weights=[1.0, 2.0], eos_id=7)
    got = _global(world(4).run(ids_case, tokens), 2)
    assert all(torch.equal(got[s + 1], want) for s, want in enumerate(_one_process(tokens, 2)))

    import datasets

    datasets.Dataset.from_dict({"text": _docs(200)}).to_parquet(str(tmp_path / "docs.parquet"))
    folder = str(tmp_path / "run")
    packed = _job(4, source="dataset", path=str(tmp_path / "docs.parquet"), tokenizer=TOKENIZER)
    packed["checkpoint"] = {"enable": True, "folder": folder, "interval": 2, "keep": 2}
    full = _global(world(4).run(ids_case, packed), 2)
    assert all(torch.equal(full[s + 1], want) for s, want in enumerate(_one_process(packed, 4)))
    copy = str(tmp_path / "resume")
    shutil.copytree(os.path.join(folder, "step-2"), os.path.join(copy, "step-2"))
    resumed = world(4).run(
        ids_case, job(**{**packed, "parallel": PP2_TP2, "checkpoint": {**packed["checkpoint"], "folder": copy}})
    )
    again = _global(resumed, 1)
    assert sorted(again) == [3, 4] and all(torch.equal(again[s], full[s]) for s in (3, 4))
    assert not np.array_equal(full[3].numpy(), full[4].numpy())
