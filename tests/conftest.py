"""Shared multi-rank worlds: one per size, started on first use and kept for the whole session."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import World  # noqa: E402

_worlds: dict[int, World] = {}


def get_world(n: int) -> World:
    if n not in _worlds:
        _worlds[n] = World(n)
    return _worlds[n]


@pytest.fixture(scope="session")
def world():
    """`world(n)` returns the session's n-rank world."""
    yield get_world
    for w in _worlds.values():
        w.close()
