"""Several cases of one world in one `World.run` round trip.

Measured on this 2-core machine (not side by side): tests/test_schedules.py's eight 4-rank matrix cases and its CSV
case took 21.4 s as nine round trips (quiet machine) and 9.7-11.3 s as one (load average 5-11, other jobs running).
A round trip saves the queue hand-offs and the stop and continue of the world between cases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Case = tuple[str, Callable[..., Any], tuple]


def cases_in_one_run(cases: list[Case]) -> dict[str, Any]:
    """Runs on every rank: each (name, fn, args) case in order; a failure names its case."""
    out = {}
    for name, fn, args in cases:
        try:
            out[name] = fn(*args)
        except Exception as e:
            raise RuntimeError(f"case {name} failed") from e
    return out


def run_cases(world, cases: list[Case]) -> dict[str, list[Any]]:
    """Every case in one round trip on `world`; per case name, the per-rank results."""
    per_rank = world.run(cases_in_one_run, cases)
    return {name: [r[name] for r in per_rank] for name, _, _ in cases}
