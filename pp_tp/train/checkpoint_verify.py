"""Each DCP checkpoint's files with their sizes and checksums, recorded at the save and verified before a resume.

DCP's `.metadata` says which tensor lives where, not whether the bytes are still there: a truncated or deleted shard
is found only inside `dcp.load`, as a zip-reader traceback on every rank naming neither the file nor an intact
checkpoint. So a save records, per rank, the size and CRC-32 of every file that rank wrote (`__{rank}_*.distcp`;
rank 0 also `.metadata`), in `.checksums-{rank}.json` beside them: computed in the writer (the async save's
background thread), on bytes just written and still in the page cache. A resume reads them back, the files split
over the ranks, and every rank reaches the same verdict. A checkpoint written before this record existed has none
and passes unverified.
"""

from __future__ import annotations

import json
import os
import zlib

import torch.distributed as dist

_SUMS = ".checksums-{}.json"
_CHUNK = 1 << 23


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def record_checksums(folder: str, rank: int, world: int) -> None:
    """Writes this rank's files of the checkpoint in `folder` with their sizes and checksums (rank 0: with the world
    size, so a resume knows every rank's record must be there)."""
    names = sorted(n for n in os.listdir(folder) if n.startswith(f"__{rank}_") or (rank == 0 and n == ".metadata"))
    files = {n: [os.path.getsize(os.path.join(folder, n)), _crc32(os.path.join(folder, n))] for n in names}
    with open(os.path.join(folder, _SUMS.format(rank)), "w") as f:
        json.dump({"world": world, "files": files} if rank == 0 else {"files": files}, f)


def _problem(folder: str, name: str, size: int, crc: int) -> str | None:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return f"{path} is missing"
    if os.path.getsize(path) != size:
        return f"{path} has {os.path.getsize(path):,} bytes, {size:,} were written"
    if _crc32(path) != crc:
        return f"{path} does not match the checksum written with it"
    return None


def _expected(folder: str) -> tuple[dict[str, list[int]], str | None]:
    """Every recorded file with its (size, crc), or the missing record that makes the checkpoint unverifiable."""
    first = os.path.join(folder, _SUMS.format(0))
    if not os.path.isfile(first):
        return {}, None  # written before checksums were recorded: nothing to verify against
    with open(first) as f:
        world = json.load(f)["world"]
    files: dict[str, list[int]] = {}
    for rank in range(world):
        path = os.path.join(folder, _SUMS.format(rank))
        if not os.path.isfile(path):
            return {}, f"{path} is missing"
        with open(path) as f:
            files.update(json.load(f)["files"])
    return files, None


def damage(folder: str) -> str | None:
    """The first problem with the checkpoint in `folder` (a file missing, resized or changed), or None when it is
    intact; the files are read split over the ranks of the default group and the verdict is the same on all."""
    files, problem = _expected(folder)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = [p for name, (size, crc) in sorted(files.items())[rank::world] if (p := _problem(folder, name, size, crc))]
    found = [problem, *mine]
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, found)
        found = [p for ps in gathered for p in ps]
    return next((p for p in found if p), None)
