"""Meshes and process groups made once per default process group, reused by every later build on the same ranks.

torch makes new process groups on every `init_device_mesh` and `new_group` call (on GPUs each holds an NCCL
communicator and its buffers). A process that builds several pipelines over the same ranks (a policy and a reference
model, a rebuild, every case of a long-lived test rank) would pile them up; here the second build gets the first's.
Every rank asks for the same keys in the same order (they come from the config), so every rank makes a group, a
collective, together or none does. A new default group (destroyed and initialized again) starts afresh.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")

_MADE: dict[Hashable, object] = {}
_UNDER: list = [None]  # the default group `_MADE` was made under


def once_per_world(key: Hashable, make: Callable[[], T]) -> T:
    """`make()`'s result for `key`, made at the first call under the current default process group."""
    if _UNDER[0] is not dist.group.WORLD:
        _MADE.clear()
        _UNDER[0] = dist.group.WORLD
    if key not in _MADE:
        _MADE[key] = make()
    return _MADE[key]  # type: ignore[return-value]
