"""Verdicts kept on disk, so the ranks of one machine, and later processes, compute each once.

A Hugging Face family's self-check and randomness verdicts (pp_tp/models/hf/record.py) take seconds of forwards on a
small copy, and every rank of every job used to run them: eight ranks of a node ran the same forwards side by side.
Here the first process to ask computes the value under an exclusive lock on its entry while the others wait, then
read what it wrote. An entry is keyed by everything the value is a function of: pp_tp's own source (a digest of
every file of the package, so any edit starts afresh), the caller's parts (the model class's name and the digest of
the file defining it, the small config, the transformers and torch versions, the question). Values are JSON (no code
is loaded from the cache). `PP_TP_CACHE_DIR` names the folder (default `$XDG_CACHE_HOME/pp_tp`, else
`~/.cache/pp_tp`); set it empty to keep nothing on disk. A folder that cannot be written, or an entry that cannot be
read, only costs the computation.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import inspect
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV = "PP_TP_CACHE_DIR"


def cache_dir() -> str | None:
    """The folder entries live in; None when `PP_TP_CACHE_DIR` is set empty."""
    if ENV in os.environ:
        return os.environ[ENV] or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pp_tp")


@functools.cache
def _package_digest() -> str:
    """A digest of every Python file of pp_tp (names and contents): a value computed by other code never counts."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def source_digest(cls: type) -> str | None:
    """A digest of the file defining `cls` (a model's own code: remote code can change under the same name); None
    where it has no readable file, and then nothing about it is kept on disk."""
    try:
        return hashlib.sha256(Path(inspect.getfile(cls)).read_bytes()).hexdigest()
    except (TypeError, OSError):
        return None


def _read(path: str) -> Any:
    with open(path) as f:
        return json.load(f)["value"]


def disk_memo(parts: list[Any], compute: Callable[[], Any]) -> Any:
    """`compute()` (a JSON value), computed once per machine for `parts` (JSON-able, naming all it depends on); a
    process asking while another computes it waits for that one's value."""
    folder = cache_dir()
    if folder is None:
        return compute()
    name = hashlib.sha256(json.dumps([_package_digest(), *parts]).encode()).hexdigest()
    path = os.path.join(folder, f"{name}.json")
    try:
        return _read(path)
    except (OSError, ValueError, KeyError):
        pass
    try:
        os.makedirs(folder, exist_ok=True)
        lock = open(f"{path}.lock", "a")  # noqa: SIM115 - held across the computation, closed below
    except OSError:
        return compute()
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this process dies
        except OSError:
            pass  # a file system without locks (some network mounts): computed here, written whole all the same
        try:
            return _read(path)  # written by the process this one waited for
        except (OSError, ValueError, KeyError):
            pass
        value = compute()
        try:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump({"value": value}, f)
            os.replace(tmp, path)
        except OSError:
            pass
        return value
