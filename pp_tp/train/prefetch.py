"""A background thread that prepares the next batches (reading, tokenizing, packing) while the step runs.

`next()` hands out batches in order and times how long the step waited for one (`wait_s`: the data time the
log shows); the checkpointed state is the loader's as of the last batch handed out, not of the ones still
queued, so a resume repeats nothing and skips nothing. `prefetch = 0` runs the loader inline.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Protocol

from pp_tp.train.packing import Batch


class Loader(Protocol):
    """What `ShardedBatches` and `PackedBatches` offer."""

    def next(self) -> Batch: ...

    def snapshot(self) -> Any: ...

    def state_dict(self, snapshot: Any = None) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Prefetcher:
    """Runs `loader.next()` up to `depth` batches ahead in a daemon thread, started on the first `next()`."""

    def __init__(self, loader: Loader, depth: int):
        self.loader, self.depth = loader, depth
        self.wait_s = 0.0
        self._snapshot = loader.snapshot()
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                item: tuple = (self.loader.next(), self.loader.snapshot(), None)
            except Exception as e:  # noqa: BLE001 - re-raised in the step that asks for this batch
                item = (None, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def next(self) -> Batch:
        start = time.perf_counter()
        if not self.depth:
            batch, self._snapshot = self.loader.next(), self.loader.snapshot()
        else:
            if self._thread is None:
                self._queue, self._stop = queue.Queue(self.depth), threading.Event()
                self._thread = threading.Thread(target=self._work, name="pp_tp-data", daemon=True)
                self._thread.start()
            batch, self._snapshot, error = self._queue.get()
            if error is not None:
                raise error
        self.wait_s = time.perf_counter() - start
        return batch

    def stop(self) -> None:
        """Ends the thread (batches it prepared are dropped; the loader restarts from the handed-out state)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def state_dict(self) -> dict:
        return self.loader.state_dict(self._snapshot)

    def load_state_dict(self, state: dict) -> None:
        self.stop()
        self.loader.load_state_dict(state)
        self._snapshot = self.loader.snapshot()
