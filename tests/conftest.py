"""Shared multi-rank worlds: one per size, started on first use and kept for the whole session."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import World, close_all  # noqa: E402

# The session's verdicts on disk (pp_tp/base/disk_memo.py): shared by its ranks and the jobs it launches, set before
# any of them starts; a fresh folder, so every run computes them once and leaves nothing in the user's cache.
_CACHE = None if "PP_TP_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="pp_tp_cache_")
if _CACHE is not None:
    os.environ["PP_TP_CACHE_DIR"] = _CACHE

_worlds: dict[int, World] = {}
# A session world is ended once its ranks hold more OS threads than this after a case (harness.World says why); 120
# first, then 60: the README's test command took 540.6 s and 529.4 s (BENCHMARKS.md, "Suite time").
RECYCLE_THREADS = 60


def get_world(n: int) -> World:
    """The n-rank world; the others are stopped while it runs (harness.World.pause)."""
    for size, w in _worlds.items():
        if size != n:
            w.pause()
    if n not in _worlds:
        _worlds[n] = World(n, RECYCLE_THREADS)
    return _worlds[n]


@pytest.fixture(autouse=True)
def _pause_worlds():
    """Every world stops after each test (harness.World.pause): idle ranks would otherwise poll gloo sockets while
    other tests (and their subprocesses) run."""
    yield
    for w in _worlds.values():
        w.pause()


@pytest.fixture(scope="session")
def world():
    """`world(n)` returns the session's n-rank world."""
    yield get_world
    close_all(list(_worlds.values()))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Under `-n 2 --dist loadgroup` (the README's command), every test on a session world runs on one worker, in
    this order, while the other worker runs the single-process tests and the launched jobs."""
    for item in items:
        if "world" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("worlds"))


def pytest_sessionfinish(session):
    if _CACHE is not None:
        shutil.rmtree(_CACHE, ignore_errors=True)
