"""Where the test suite's CPU goes, per test: a pytest plugin (issue 46, item 6).

    PYTHONPATH=bench python -m pytest -q -p suite_cpu [-n 2 --dist loadgroup] tests
    python bench/suite_cpu.py OUT_DIR                    # the per-file table of a run

Wall time on this machine moves by 10-30 % from one run to the next (BENCHMARKS.md, "Suite time"), and a test on a
shared world reads slower while the other pytest-xdist worker runs. CPU seconds do not depend on what shares the
cores (they still follow the machine's own speed), so per test this writes one JSON line to `$SUITE_CPU_DIR`
(default /tmp/suite_cpu) with: `own`, the test process's CPU; `children`, the CPU of processes it started and reaped
(launched jobs); `ranks`, by world size and user/system, the CPU its session worlds' ranks used (read from /proc
before the test, after it, and before a world's ranks leave, so a world recycled after a case still counts;
tests/harness.py). Ranks are the forkserver's children, not the test process's, so getrusage cannot see them. The
forkserver's own import is not counted.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import resource
import sys
import time
from typing import Any

import pytest

OUT = os.environ.get("SUITE_CPU_DIR", "/tmp/suite_cpu")
_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> tuple[float, float] | None:
    """(user, system) seconds of a live process, from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) / _TICK, int(fields[12]) / _TICK


class RankCpu:
    """CPU the ranks of every session world used since `start`, by (world size, "u" or "s")."""

    def __init__(self) -> None:
        self.last: dict[int, tuple[float, float]] = {}
        self.used: collections.Counter = collections.Counter()

    def sample(self, world: Any) -> None:
        for p in world._procs:
            now = _proc_cpu(p.pid)
            if now is not None:
                before = self.last.get(p.pid, (0.0, 0.0))
                self.used[(world.world_size, "u")] += now[0] - before[0]
                self.used[(world.world_size, "s")] += now[1] - before[1]
                self.last[p.pid] = now

    def forget(self, world: Any) -> None:
        """Drops a leaving world's ranks, so a later process the OS gives one of their pids starts from zero."""
        for p in world._procs:
            self.last.pop(p.pid, None)

    def sample_all(self) -> None:
        import conftest

        for world in conftest._worlds.values():
            self.sample(world)

    def start(self) -> None:
        self.sample_all()
        self.used.clear()


_RANKS = RankCpu()
_FILE: list = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if not _FILE:
        import harness

        leave = harness.World._leave

        def counted_leave(world: Any) -> None:  # a world's ranks are sampled before they go
            _RANKS.sample(world)
            _RANKS.forget(world)
            leave(world)

        harness.World._leave = counted_leave
        os.makedirs(OUT, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _FILE.append(open(os.path.join(OUT, f"{worker}_{os.getpid()}.jsonl"), "w"))
    _RANKS.start()
    t0 = time.perf_counter()
    own0, kids0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    yield
    _RANKS.sample_all()
    own1, kids1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    row = dict(
        id=item.nodeid,
        wall=time.perf_counter() - t0,
        own=(own1.ru_utime - own0.ru_utime) + (own1.ru_stime - own0.ru_stime),
        children=(kids1.ru_utime - kids0.ru_utime) + (kids1.ru_stime - kids0.ru_stime),
        ranks={f"{size}{kind}": round(v, 2) for (size, kind), v in _RANKS.used.items() if v},
    )
    _FILE[0].write(json.dumps(row) + "\n")
    _FILE[0].flush()


def per_file(out: str) -> None:
    """The run's CPU per test file, largest first: own, children, ranks (user + system) by world size."""
    rows = [json.loads(line) for path in glob.glob(os.path.join(out, "*.jsonl")) for line in open(path)]
    files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows:
        c = files[r["id"].split("::")[0]]
        c["wall"] += r["wall"]
        c["own"] += r["own"]
        c["children"] += r["children"]
        for key, v in r["ranks"].items():
            c[f"ranks {key[:-1]}"] += v
    sizes = sorted({k for c in files.values() for k in c if k.startswith("ranks")}, key=lambda k: int(k.split()[1]))
    cols = ["cpu", "wall", "own", "children", *sizes]
    print("| file | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    total: collections.Counter = collections.Counter()
    for c in files.values():
        c["cpu"] = c["own"] + c["children"] + sum(c[k] for k in sizes)
        total.update(c)
    for name, c in sorted(files.items(), key=lambda kv: -kv[1]["cpu"]):
        print(f"| {name} | " + " | ".join(f"{c[k]:.1f}" for k in cols) + " |")
    print("| all | " + " | ".join(f"{total[k]:.1f}" for k in cols) + " |")


if __name__ == "__main__":
    per_file(sys.argv[1] if len(sys.argv) > 1 else OUT)
