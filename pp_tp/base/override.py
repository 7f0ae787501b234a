"""A function a run without values can replace for the length of a `with` block.

The planner builds stages on fake tensors, where routing has no values to read; the code that reads them (expert
dispatch's split sizes, the reference experts' slot counts) asks its `Override` for the function to call, and the
planner installs its own for the search. One stack per override, the newest installed wins.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Override(Generic[F]):
    """The function in force: `default`, or the newest one installed by `installed`."""

    def __init__(self, default: F):
        self.default = default
        self._stack: list[F] = []

    def __call__(self) -> F:
        return self._stack[-1] if self._stack else self.default

    @contextmanager
    def installed(self, fn: F) -> Iterator[None]:
        """Every call inside the block gets `fn`."""
        self._stack.append(fn)
        try:
            yield
        finally:
            self._stack.remove(fn)
