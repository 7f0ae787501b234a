"""A trainer entry that hard-kills one rank at one step, for the dead-peer and restart tests.

`python tests/kill_entry.py RANK:STEP --config F ...`: rank RANK exits with code 13 before step STEP, on a
torchrun job's first attempt only (TORCHELASTIC_RESTART_COUNT 0 or unset).
`RANK:STEP:write`: rank RANK exits with code 13 inside the write of step STEP's checkpoint (in the background under
checkpoint.async), once its own shard is on disk and before DCP's metadata is: the save is half done.
"""

import os
import sys

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.elastic.multiprocessing.errors import record

from pp_tp.cli.train import main


def _first_attempt(rank: int) -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and dist.get_rank() == rank


def kill_at(rank: int, at: int):
    def before_step(step: int) -> None:
        if _first_attempt(rank) and step == at:
            os._exit(13)

    return before_step


def kill_in_write(rank: int, at: int) -> None:
    """Wraps DCP's file writer so that rank `rank` dies right after writing its shard of step `at`'s checkpoint."""
    write_data = FileSystemWriter.write_data

    def dying(self, plan, planner):
        written = write_data(self, plan, planner)
        if _first_attempt(rank) and os.path.basename(str(self.path)) == f".step-{at}.tmp":
            written.wait()
            os._exit(13)
        return written

    FileSystemWriter.write_data = dying


if __name__ == "__main__":
    rank, at, *where = sys.argv[1].split(":")
    if where == ["write"]:
        kill_in_write(int(rank), int(at))
    before_step = None if where else kill_at(int(rank), int(at))
    raise SystemExit(record(main)(sys.argv[2:], before_step))
