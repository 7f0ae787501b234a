"""Host syncs: every place the host waits for tensor values during a region, counted and located.

On a GPU each one drains the launch queue. Counted, on this rank:
- aten's `_local_scalar_dense` (`item()`, `bool()`, `int()`, `float()` of a tensor);
- ops whose output shape depends on values, which read a count on CUDA to size their output (`nonzero`,
  `masked_select`, `unique`, `bincount`, indexing with a boolean mask, `repeat_interleave` without `output_size`);
- `Tensor.tolist()` and `.numpy()`, which on CPU read data without any aten op, so a dispatch mode alone misses
  them: they are patched for the region.

Usage (every rank counts its own)::

    with HostSyncs() as syncs:
        pipe.step(ids, labels)
    syncs.count, syncs.where   # total, and Counter{"file.py:line (op)": n}

The mode rides into backward like CommLedger's; compiled regions are not inspected.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import torch

from pp_tp.base._torch import TorchDispatchMode

# aten overload packets whose output shape needs values (CUDA reads them back), besides _local_scalar_dense
_VALUE_SHAPED = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive"}
_PATCHED = ("tolist", "numpy")


def _reads_values(func: Any, args: tuple, kwargs: dict) -> bool:
    name = func.overloadpacket.__name__
    if name in _VALUE_SHAPED or name == "_local_scalar_dense":
        return True
    if name == "bincount":  # CUDA sizes the output by max(values)
        return True
    if name == "repeat_interleave":  # repeats as a tensor: the output size is their sum, unless given
        return (
            isinstance(args[0], torch.Tensor) and kwargs.get("output_size", args[2] if len(args) > 2 else None) is None
        )
    if name in ("index", "index_put", "index_put_"):
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return False


def _caller() -> str:
    """The innermost frame outside torch and this file: where the read was asked for."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and not path.endswith("host_syncs.py"):
            return f"{path.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


class HostSyncs(TorchDispatchMode):
    """Counts host syncs (module docstring) while entered; `where` keys them by caller and op."""

    def __init__(self) -> None:
        super().__init__()
        self.where: Counter = Counter()
        self._saved: dict[str, Any] = {}

    @property
    def count(self) -> int:
        return sum(self.where.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _reads_values(func, args, kwargs):
            self.where[f"{_caller()} ({func.overloadpacket.__name__})"] += 1
        return func(*args, **kwargs)

    def _patch(self, name: str) -> None:
        original = getattr(torch.Tensor, name)
        self._saved[name] = torch.Tensor.__dict__.get(name)

        def read(t: torch.Tensor, *a: Any, **k: Any) -> Any:
            self.where[f"{_caller()} ({name})"] += 1
            return original(t, *a, **k)

        setattr(torch.Tensor, name, read)

    def __enter__(self) -> HostSyncs:
        for name in _PATCHED:
            self._patch(name)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for name, saved in self._saved.items():
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)
        self._saved.clear()
