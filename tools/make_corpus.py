"""Writes the shipped document corpus: jsonl shards of generated English documents (`{"text": ...}` rows), the
README's `data.source = "dataset"` demo with document masking.

    python tools/make_corpus.py examples/corpus --docs 1200 --shards 2

Document i is paragraph (seed 1, i) of pp_tp's generator (`pp_tp.train.data.paragraph`): deterministic, so the
files are the generator's output (tests/test_data_sources.py checks it).
"""

from __future__ import annotations

import argparse
import json
import os

from pp_tp.train.data import paragraph

SEED = 1  # the byte-level text pp_tp/data/patterns.txt is seed 0's


def shard_rows(docs: int, shards: int) -> list[list[str]]:
    """The jsonl lines of each shard: documents split into `shards` contiguous runs."""
    per = -(-docs // shards)
    rows = [json.dumps({"id": i, "text": paragraph(SEED, i).strip()}) + "\n" for i in range(docs)]
    return [rows[k * per : (k + 1) * per] for k in range(shards)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--docs", type=int, default=1200)
    parser.add_argument("--shards", type=int, default=2)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for k, rows in enumerate(shard_rows(args.docs, args.shards)):
        with open(os.path.join(args.out, f"part-{k}.jsonl"), "w") as f:
            f.writelines(rows)


if __name__ == "__main__":
    main()
