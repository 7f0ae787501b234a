"""A DP rank's memory against the corpus size: token files 10x larger than the rank's own resident set.

    python bench/data_memory.py                     # 0.4 GB and 4 GB uint16 token files in a temporary folder
    python bench/data_memory.py --gib 0.2 2

For each size, a fresh process opens `data.source = "tokens"` (the id check scans the whole file), takes DP
rank 1 of 2's loader and reads 50 batches of 16 x 1024 tokens. It prints the process's anonymous resident
memory (`RssAnon`: what the rank itself holds), its mapped file pages (`RssFile`: torch's libraries; a window's
pages of the memory map are released once copied out) and its peak resident set (`VmHWM`), from /proc/self/status.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
from common import table

CHUNK = 1 << 26  # tokens written per chunk


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(key + ":"))
    return int(line.split()[1]) / 2**20  # kB -> GiB


def measure(path: str) -> str:
    """In this process: open the file as the job's data, read 50 batches on DP rank 1 of 2; the memory figures."""
    from pp_tp.config import config_from_dict
    from pp_tp.train.sources import make_source

    before = _status("RssAnon"), _status("RssFile")
    d = {
        "model": {"vocab_size": 50_000, "max_seq_len": 1024, "dim": 32, "n_heads": 4, "ffn_dim": 64},
        "parallel": {"pp": 1, "dp_shard": 2},
        "training": {"batch_size": 16, "seq_len": 1024},
        "data": {"source": "tokens", "path": path},
    }
    loader = make_source(config_from_dict(d, world_size=2)).loader(1, 2)
    for _ in range(50):
        loader.next()
    after = _status("RssAnon"), _status("RssFile"), _status("VmHWM")
    return " ".join(f"{x:.3f}" for x in (before[0], after[0], before[1], after[1], after[2]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, nargs="+", default=[0.4, 4.0])
    a = parser.parse_args()
    rows = [("corpus GiB", "RssAnon before", "RssAnon after", "RssFile before", "RssFile after", "VmHWM")]
    with tempfile.TemporaryDirectory() as tmp:
        for gib in a.gib:
            path = os.path.join(tmp, f"{gib}.bin")
            gen, left = np.random.default_rng(0), int(gib * 2**30) // 2
            with open(path, "wb") as f:
                while left > 0:
                    n = min(CHUNK, left)
                    gen.integers(0, 50_000, n, dtype=np.uint16).tofile(f)
                    left -= n
            code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import data_memory as m; "
            out = subprocess.run(
                [sys.executable, "-c", code + f"print(m.measure({path!r}))"], check=True, capture_output=True, text=True
            ).stdout.split()[-5:]
            rows.append((f"{os.path.getsize(path) / 2**30:.2f}", *out))
            os.remove(path)
    print("GiB per process (one DP rank's loader, 50 batches of 16 x 1024 tokens)")
    print(table(rows))


if __name__ == "__main__":
    main()
