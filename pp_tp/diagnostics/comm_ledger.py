"""A communication ledger: counts and bytes of every collective and p2p op this rank issues.

Usage (on every rank; each rank records its own traffic)::

    from pp_tp.diagnostics.comm_ledger import CommLedger

    with CommLedger() as led:
        for i in range(3):
            led.next_step()                  # optional: start a new step record
            pipe.step(ids, labels)
    led.counts()          # {"all_gather": 6, "reduce_scatter": 6, "all_reduce": 9, "send": 12, ...} all steps
    led.counts(step=-1)   # the last step only
    led.bytes(step=1)     # payload bytes per kind in step 1
    led.counts(step=-1, group=mesh.get_group("dp_shard"))   # only FSDP's dp_shard traffic
    led.events            # every op: CommEvent(step, kind, op, nbytes, group, group_size)

Keys: "all_gather", "reduce_scatter", "all_reduce", "broadcast", "send", "recv", and when they occur
"all_to_all", "gather", "scatter", "reduce", "barrier". Steps are numbered from 0; without
`next_step()` everything lands in step 0, and a step without any communication gets no number.
`nbytes` is the op's payload on this rank: the largest tensor (or tensor list) it reads or writes,
i.e. the gathered output of an all-gather, the unreduced input of a reduce-scatter, the tensor of an
all-reduce / broadcast / send / recv. `group` is the process group's group_name: FSDP uses the
dp_shard group (all-gather, reduce-scatter; HSDP adds an all-reduce on dp_replicate), TP the tp group,
pipelining the pp group.

How it sees the ops: a TorchDispatchMode (the mechanism of torch's CommDebugMode) watching the
``c10d`` ops that torch.distributed's Python API dispatches to (FSDP2's all_gather_single /
reduce_scatter_single, pipelining's batch_isend_irecv, loss all-reduces) and the
``_c10d_functional`` ops of DTensor redistribution (TP). The mode is thread-local state that the
autograd engine carries into backward, so collectives issued from backward hooks are recorded too.
DTensor ops are let through first so that the collectives they lower to are seen.
Cost: every op of the step passes through Python while the ledger is open; measure time outside it.
Compiled regions (torch.compile) are not inspected.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pp_tp.base._torch import (
    TorchDispatchMode,
    process_group_type,
    resolve_process_group,
    tree_flatten,
)

# op name (overload packet, namespace dropped) -> ledger key
_KINDS = {
    # torch.distributed (c10d) ops
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "gather_": "gather",
    "scatter_": "scatter",
    "reduce_": "reduce",
    "barrier": "barrier",
    # functional collectives (DTensor)
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "broadcast": "broadcast",
    "all_to_all_single": "all_to_all",
}
_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional")

GroupLike = dist.ProcessGroup | str | None


@dataclass(frozen=True)
class CommEvent:
    step: int
    kind: str
    op: str
    nbytes: int
    group: str | None
    group_size: int | None


def _payload_bytes(values: Any) -> int:
    """The largest per-argument tensor payload: a list of tensors counts as the sum of its tensors."""
    best = 0
    for value in values:
        leaves, _ = tree_flatten(value)
        best = max(best, sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)))
    return best


def _group_of(args: tuple[Any, ...]) -> tuple[str | None, int | None]:
    """(name, size) of the op's process group: c10d ops carry it boxed, functional collectives by name."""
    ProcessGroup = process_group_type()
    for a in reversed(args):
        try:
            if isinstance(a, torch.ScriptObject):
                pg = ProcessGroup.unbox(a)
            elif isinstance(a, str):
                pg = resolve_process_group(a)
            else:
                continue
        except (RuntimeError, ValueError, KeyError):
            continue
        return pg.group_name, pg.size()
    return None, None


class CommLedger(TorchDispatchMode):
    """Records this rank's communication while active; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[CommEvent] = []
        self.step = 0

    def next_step(self) -> None:
        """Starts a new step record, unless the current one is still empty (so calling it before every
        step, or after every step, numbers the steps 0, 1, 2, ... alike)."""
        if self.events and self.events[-1].step == self.step:
            self.step += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if DTensor in types:
            return NotImplemented  # let DTensor lower the op first; the collectives it issues come back here
        out = func(*args, **kwargs)
        packet = getattr(func, "overloadpacket", None)
        ns = getattr(func, "namespace", None)
        if packet is not None and ns in _NAMESPACES:
            kind = _KINDS.get(packet.__name__)
            if kind is not None:
                self.events.append(
                    CommEvent(
                        self.step,
                        kind,
                        f"{ns}.{packet.__name__}",
                        _payload_bytes(list(args) + list(kwargs.values()) + [out]),
                        *_group_of(args),
                    )
                )
        return out

    def _select(self, step: int | None, group: GroupLike) -> list[CommEvent]:
        events = self.events
        if step is not None:
            if step < 0:  # counted from the last step that recorded anything
                step += (events[-1].step if events else 0) + 1
            events = [e for e in events if e.step == step]
        if group is not None:
            name = group if isinstance(group, str) else group.group_name
            events = [e for e in events if e.group == name]
        return events

    def counts(self, step: int | None = None, group: GroupLike = None) -> dict[str, int]:
        """Number of ops per kind, over all steps or in one step (negative counts from the last),
        optionally only those on one process group (a ProcessGroup or its group_name)."""
        return dict(Counter(e.kind for e in self._select(step, group)))

    def bytes(self, step: int | None = None, group: GroupLike = None) -> dict[str, int]:
        """Payload bytes per kind; `step` and `group` as in counts()."""
        total: Counter[str] = Counter()
        for e in self._select(step, group):
            total[e.kind] += e.nbytes
        return dict(total)
