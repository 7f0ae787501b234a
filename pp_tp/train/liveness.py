"""Naming the rank that died. The process group only reports that a connection dropped (gloo) or a collective
timed out (NCCL), never whose process is gone, so each rank bumps a heartbeat counter in the rendezvous
store; when a step fails, a counter that stopped moving names a dead rank.

The store is torchrun's (hosted by the agent, or by rank 0 without an agent); if it is gone too, the
original error is raised unchanged.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

_runs = itertools.count()  # every rank creates its watches in the same order, so keys agree across ranks


class PeerDiedError(RuntimeError):
    """A step failed because other ranks died; the message names them."""


class PeerWatch:
    """A daemon thread bumping this rank's counter every `interval` seconds while training runs."""

    def __init__(self, interval: float = 0.5):
        self.interval = interval
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=30)
        )
        self.store = dist.PrefixStore(f"pp_tp/liveness/{attempt}/{next(_runs)}/", store)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="pp_tp-heartbeat")
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(f"beat/{self.rank}", 1)
            except RuntimeError:  # the store is gone: the job is ending anyway
                return
            self._stop.wait(self.interval)

    def _beats(self) -> list[int]:
        return [self.store.add(f"beat/{r}", 0) for r in range(self.world)]

    def dead_ranks(self) -> list[int]:
        """Ranks whose heartbeat stood still for a few intervals and that did not report a failure themselves."""
        self.store.set(f"failed/{self.rank}", "1")
        before = self._beats()
        time.sleep(4 * self.interval)
        after = self._beats()
        return [r for r in range(self.world) if before[r] == after[r] and not self.store.check([f"failed/{r}"])]

    @contextlib.contextmanager
    def naming_dead_peers(self, step: int) -> Iterator[None]:
        """Turns a failed step into a PeerDiedError naming the dead ranks, when some are dead."""
        try:
            yield
        except RuntimeError as e:
            try:
                dead = self.dead_ranks()
            except RuntimeError:
                raise e from None
            if dead:
                raise PeerDiedError(
                    f"rank {self.rank}: step {step} failed because rank(s) {dead} died "
                    f"(heartbeat stopped); first error here: {str(e).splitlines()[0]}"
                ) from e
            raise

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
