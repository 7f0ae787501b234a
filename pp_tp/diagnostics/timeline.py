"""Schedule pictures: a real step on every rank and the simulated schedule as one Chrome/Perfetto trace.

Open the JSON at https://ui.perfetto.dev (or chrome://tracing): one process row per rank, compute
(F, B, I, W, loss) on one track and pipeline p2p waits / gradient reduction on another; the empty
stretches are the bubble. The simulated schedule of the same (schedule, pp, m) sits below the
measured one, so the measured bubble can be read next to the predicted one.

Bubble fraction here is idle time over compute time per rank (Narayanan et al. 2021: (p-1)/m for
GPipe and 1F1B, (p-1)/(v*m) interleaved), so measured, simulated and theoretical values compare directly.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from pp_tp.base._torch import patch_schedule_timing, schedule_stages
from pp_tp.planner.schedule_sim import Span

# ---------------------------------------------------------------------------------------------
# Recording a real step


class StepRecorder:
    """Records this rank's compute and p2p spans while a pipeline schedule runs one step.

    Wraps, on the instances only, the stages' forward/backward chunk calls and gradient reduction and
    the schedule's loss; and, for the `with` block, torch's p2p wait helper, which both its
    single-stage and runtime schedules call. Everything is restored on exit.
    """

    _STAGE_CALLS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "perform_reduce_grad")

    def __init__(self, schedule: Any, rank: int | None = None):
        self.schedule = schedule
        self.stages = schedule_stages(schedule)
        self.rank = rank if rank is not None else self.stages[0].group_rank
        self.spans: list[Span] = []
        self.t0 = 0.0
        self.wall = 0.0

    def _timed(self, fn: Callable, name: Callable[..., str | None], kind: str) -> Callable:
        """`fn` recording a span named `name(*args)` (None: not recorded)."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                label = name(*args, **kwargs)
                if label is not None:
                    self.spans.append(Span(self.rank, label, kind, t - self.t0, end - t))

        return wrapper

    def _stage_wrappers(self, stage: Any) -> dict[str, Callable]:
        s = stage.stage_index
        names = {
            "forward_one_chunk": lambda mb, *a, **k: f"{s}F{mb}",
            "backward_one_chunk": lambda mb, *a, **k: f"{s}{'B' if k.get('full_backward', True) else 'I'}{mb}",
            "backward_weight_one_chunk": lambda mb, *a, **k: f"{s}W{mb}",
            "perform_reduce_grad": lambda *a, **k: f"{s} reduce_grad",
        }
        return {
            call: self._timed(getattr(stage, call), names[call], "comm" if call == "perform_reduce_grad" else "compute")
            for call in self._STAGE_CALLS
        }

    def __enter__(self) -> StepRecorder:
        for stage in self.stages:
            for call, wrapper in self._stage_wrappers(stage).items():
                setattr(stage, call, wrapper)
        self._undo = patch_schedule_timing(
            self.schedule,
            lambda loss: self._timed(
                loss, lambda stage, out, tgt, mb, *a: f"{stage.stage_index}L{mb}" if stage.is_last else None, "compute"
            ),
            lambda wait: self._timed(wait, lambda *a, **k: "p2p wait", "comm"),
        )
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self.t0
        self._undo()
        for stage in self.stages:
            for call in self._STAGE_CALLS:
                del stage.__dict__[call]


def record_step(
    schedule: Any, step: Callable[[], Any], group: dist.ProcessGroup | None = None
) -> tuple[list[Span], float]:
    """Runs `step()` between two barriers of `group`, recording it; returns this rank's spans and wall seconds."""
    dist.barrier(group=group)
    with StepRecorder(schedule) as rec:
        step()
        dist.barrier(group=group)
    return rec.spans, rec.wall


# ---------------------------------------------------------------------------------------------
# Chrome trace


def chrome_trace(sections: list[tuple[str, list[Span], float]]) -> dict:
    """Trace JSON, one process per (section, rank); a section is (label, spans, microseconds per span unit):
    1e6 for measured spans (seconds), the chosen length of one cost unit for simulated ones."""
    events: list[dict] = []
    for i, (label, spans, us_per_unit) in enumerate(sections):
        for r in sorted({s.rank for s in spans}):
            pid = 1000 * i + r
            events += [
                {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{label} rank {r}"}},
                {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}},
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "compute"}},
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": "comm"}},
            ]
        events += [
            {
                "name": s.name,
                "cat": s.kind,
                "ph": "X",
                "pid": 1000 * i + s.rank,
                "tid": 0 if s.kind == "compute" else 1,
                "ts": s.start * us_per_unit,
                "dur": s.dur * us_per_unit,
            }
            for s in spans
        ]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str, trace: dict) -> None:
    with open(path, "w") as f:
        json.dump(trace, f)
