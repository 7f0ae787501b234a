"""The fake world: this process as rank 0 of any world size on torch's `fake` process-group backend."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from pp_tp.base._torch import fake_store
from pp_tp.errors import ConfigError


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """This process as rank 0 of a `world_size` world on torch's fake backend, for the `with` block."""
    if dist.is_initialized():
        raise ConfigError(
            "pp-tp plan: a process group already exists in this process; run the dry run in a "
            "process of its own (the `pp-tp plan` command does)"
        )
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
