"""A trainer entry that hard-kills one rank at one step, for the dead-peer and restart tests.

`python tests/kill_entry.py RANK:STEP --config F ...`: rank RANK exits with code 13 before step STEP, on a
torchrun job's first attempt only (TORCHELASTIC_RESTART_COUNT 0 or unset).
"""

import os
import sys

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from pp_tp.cli.train import main


def kill_at(rank: int, at: int):
    def before_step(step: int) -> None:
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and dist.get_rank() == rank and step == at:
            os._exit(13)

    return before_step


if __name__ == "__main__":
    rank, at = (int(x) for x in sys.argv[1].split(":"))
    raise SystemExit(record(main)(sys.argv[2:], kill_at(rank, at)))
