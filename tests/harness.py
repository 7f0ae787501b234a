"""Multi-rank tests on gloo: start a world of N processes once, run many cases in it.

Process start (importing torch, rendezvous) is the costly part, so a `World` keeps its ranks alive and
feeds them cases through queues. A case is a module-level function called on every rank; its return
values (one per rank) come back to the test. A failing rank's traceback is re-raised in the test; a
case that fails or hangs tears the world down so the next case starts from a clean one.

DTensor's sharding-propagation caches live as long as the rank. torch's DeviceMesh equality ignores process groups,
so a cached output spec computed on one mesh is handed to any later equal mesh. Every mesh a case builds comes from
pp_tp's `make_mesh` or `parity_utils.flat_mesh`, made once per shape and world (pp_tp/base/per_world.py), but the
submeshes of two shapes can still be equal (the "tp" of pp2 x tp2 and of pp1 x dp2 x tp2 over the same ranks), so
every build on another mesh than the last one empties the caches first (pp_tp/parallel/mesh.py `build_on`; before it,
test_nonlm's TP ledger counted 0 all-reduces after test_dropout_rng's pp1 x dp2 x tp2 case, in the order two
`--dist loadfile` workers ran them). torchtitan's Trainer builds its meshes itself: a spec handed from one of them to
an equal later one runs the same collective over the same ranks, on the earlier groups.

Between its cases a world is stopped (SIGSTOP, `pause`): every gloo process group keeps a transport thread that
wakes about every 10 ms even when idle, and with tens of groups per rank and several worlds alive, idle ranks
took about one of this machine's two cores (measured: 5-18 % CPU each for 13 idle ranks).

The ranks are forked from a forkserver that imported torch, pp_tp and transformers once (`_PRELOAD`): a spawned rank
paid that import itself, for every rank of every world. The rendezvous store is held by the test process on a port
the OS picks (`TCPStore(port=0)`), so no other process (another world, another pytest-xdist worker) can take the port
between its choice and its use, as a probed free port could.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import random
import signal
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

CASE_TIMEOUT_S = float(os.environ.get("PP_TP_CASE_TIMEOUT", "600"))
# Bounds every collective: when one rank fails, its peers error out instead of waiting forever.
PG_TIMEOUT_S = 60
# What every rank imports anyway, imported once in the forkserver its ranks are forked from; with transformers
# installed, also what every Hugging Face case imports (measured: ~3.4 s per rank of every world, paid once here);
# then the tests' shared helpers and the integrations many worlds' cases import (py-spy over the suite: ranks spent
# ~60 s importing test modules and what they import, torchtitan's and the HF Trainer's stacks most; 1.7 s here).
_PRELOAD = ["torch", "torch.distributed.pipelining", "torch.distributed.tensor", "pp_tp", "parity_utils", "one_trip"]
_PRELOAD += [
    module
    for package, modules in (
        (
            "transformers",
            ["transformers.modeling_utils", "transformers.models.auto.modeling_auto", "pp_tp.models.hf.build"]
            + ["transformers.models.llama.modeling_llama", "hf_utils"],
        ),
        ("trl", ["pp_tp.integrations.hf_trainer", "pp_tp.integrations.hf_sft"]),
        ("torchtitan", ["titan_utils"]),
    )
    if importlib.util.find_spec(package)
    for module in modules
]
# How long ranks asked to leave get before they are killed, shared by all worlds closing together.
LEAVE_GRACE_S = 2.0


class RankError(AssertionError):
    """A case failed on one or more ranks; the message holds each failing rank's traceback."""


def _free_port() -> int:
    """A port free now, for a process that binds it itself (a torchrun-less job's rank 0). It lies below the kernel's
    ephemeral range: a port from inside it (bind to 0) can be taken by any process's outgoing connection, such as a
    gloo world's, before the job binds it (seen in CI as EADDRINUSE)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except OSError:
        low = 32768
    rng = random.Random()  # seeded from the OS: two test processes do not walk the same ports
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below the ephemeral range (starts at {low})")


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    # MASTER_PORT names the test process's store: pp_tp's liveness watch (train/liveness.py) connects to it too.
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch

    torch.set_num_threads(1)
    timeout = timedelta(seconds=PG_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    while True:
        task = tasks.get()
        if task is None:
            break
        case_id, fn, args, kwargs = task
        try:
            results.put((case_id, rank, True, fn(*args, **kwargs), os_threads()))
        except BaseException:  # noqa: BLE001 - everything goes back to the test
            results.put((case_id, rank, False, traceback.format_exc(), os_threads()))
    dist.destroy_process_group()


def os_threads() -> int:
    """This process's OS threads (gloo's are native: `threading` does not see them); 0 where /proc is missing."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


class World:
    """N gloo ranks kept alive across cases. `run(fn, ...)` returns the list of per-rank results.

    `recycle_threads`: after a case whose ranks hold more OS threads than that, the world ends and the next case
    starts a fresh one (None: never; a caller keeping state in its ranks between cases, as bench/ does, keeps None).
    Every gloo process group keeps three threads, one waking about every 10 ms even when idle, and cases that build
    meshes of their own leave their groups behind: after tests/test_[a-l]*.py a rank of the session's world held 483
    threads (about 160 groups) and the same case took 2x the CPU it took in a fresh world (0.39 -> 0.80 s)."""

    def __init__(self, world_size: int, recycle_threads: int | None = None):
        self.world_size = world_size
        self.recycle_threads = recycle_threads
        self._procs: list = []
        self._store: dist.TCPStore | None = None
        self._case = 0

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = self._store.port
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.world_size, port, self._tasks[r], self._results), daemon=True)
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def _signal(self, sig: int) -> None:
        for p in self._procs:
            if p.is_alive():
                os.kill(p.pid, sig)

    def pause(self) -> None:
        """Stops the ranks between cases (they hold no collective then); `run` continues them."""
        self._signal(signal.SIGSTOP)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = CASE_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        if not self._procs:
            self._start()
        self._signal(signal.SIGCONT)
        self._case += 1
        for q in self._tasks:
            q.put((self._case, fn, args, kwargs))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline, most = time.monotonic() + timeout, 0
        while len(out) + len(errors) < self.world_size and time.monotonic() < deadline:
            if errors or not all(p.is_alive() for p in self._procs):
                # Peers of a failed or dead rank end at the collective timeout: do not wait for the full case.
                deadline = min(deadline, time.monotonic() + PG_TIMEOUT_S + 30)
            try:
                case_id, rank, ok, value, threads = self._results.get(timeout=1.0)
            except queue.Empty:
                continue
            if case_id == self._case:
                (out if ok else errors)[rank] = value
                most = max(most, threads)
        if errors or len(out) < self.world_size:
            self.close()
            missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
            msg = [
                f"case {fn.__module__}.{fn.__name__} failed on ranks {sorted(errors)}"
                + (f"; no answer from ranks {missing}" if missing else "")
            ]
            msg += [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
            raise RankError("\n".join(msg))
        if self.recycle_threads is not None and most > self.recycle_threads:
            self.close()  # the next case starts a fresh world
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Ends the ranks: asked to leave, then killed after a short shared grace period (a rank tearing down its
        gloo groups, or stuck with a failed peer, must not cost seconds each)."""
        close_all([self])

    def _leave(self) -> None:
        self._signal(signal.SIGCONT)
        for q, p in zip(self._tasks if self._procs else [], self._procs):
            if p.is_alive():
                q.put(None)

    def _reap(self, deadline: float) -> None:
        for p in self._procs:
            p.join(timeout=max(deadline - time.monotonic(), 0))
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
        self._store = None  # the rendezvous store's server ends with the world


def close_all(worlds: list[World]) -> None:
    """Closes the worlds together: all are asked to leave first, then one grace period is shared by all (each world's
    own period, one after another, was most of the session's teardown: 8.8 s for four worlds)."""
    for w in worlds:
        w._leave()
    deadline = time.monotonic() + LEAVE_GRACE_S
    for w in worlds:
        w._reap(deadline)
