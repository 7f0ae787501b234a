"""One verdict on every rank: local work whose failure must end every rank alike, never some ranks only.

A rank that refuses a job while its peers go on leaves them blocked in their first collective (or, worse, one
rank trains what another refused). So the rank-local build runs under `agreed`: afterwards one small
all-gather compares the outcomes, and every rank raises the same `ConfigError` line (the lowest refusing rank's)
or every rank goes on. torch has no "agree on an exception" primitive; this is that one exchange.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from pp_tp.errors import ConfigError

T = TypeVar("T")


def agreed(work: Callable[[], T]) -> T:
    """`work()` on this rank, then one exchange over the default group: its result when every rank succeeded,
    else the same error on every rank (a refusal as the lowest refusing rank's `ConfigError`; a crash re-raised
    where it happened and named on the others)."""
    error: BaseException | None = None
    try:
        result, mine = work(), None
    except ConfigError as e:
        error, mine = e, ("refused", str(e))
    except Exception as e:  # noqa: BLE001 - reported to every peer, then re-raised here
        error, mine = e, ("crashed", f"{type(e).__name__}: {e}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:  # on torch's fake backend (one process) the gather hands back this rank's outcome for every rank
        outcomes: list = [None] * world
        dist.all_gather_object(outcomes, mine)
    else:
        outcomes = [mine]
    refusals = [o[1] for o in outcomes if o is not None and o[0] == "refused"]
    if refusals:
        raise ConfigError(refusals[0]) from error
    crashes = [(rank, o[1]) for rank, o in enumerate(outcomes) if o is not None]
    if error is not None:
        raise error
    if crashes:
        rank, what = crashes[0]
        raise RuntimeError(f"rank {rank} failed while building the pipeline ({what}); see that rank's traceback")
    return result
