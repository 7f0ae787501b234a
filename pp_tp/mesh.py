"""The device mesh: ("pp", "dp_replicate", "dp_shard", "tp"), NCCL on CUDA, gloo on CPU.

The process group comes from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), so one
node and many nodes are the same code path.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pp_tp.config import ParallelConfig, resolve_dp_shard
from pp_tp.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def rank_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device on `mesh`: its current CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")


def init_distributed(timeout_s: float = 300.0) -> None:
    """Initializes the default process group from torchrun's env if nobody did yet.

    The timeout bounds every collective: a dead peer ends the others with an error instead of a hang.
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError(
            "no process group: launch with torchrun (RANK/WORLD_SIZE unset) or call "
            "torch.distributed.init_process_group first"
        )
    if device_type() == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
    timeout = timedelta(seconds=timeout_s)
    store_args = {}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun keeps one agent store across restarts: without a per-attempt prefix a restarted gloo
        # group reads the dead attempt's peer addresses and fails to connect (seen on torch 2.13).
        agent = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store_args = {
            "store": dist.PrefixStore(f"pp_tp/attempt_{attempt}/", agent),
            "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"]),
        }
    dist.init_process_group(backend, timeout=timeout, **store_args)


def mesh_shape(pcfg: ParallelConfig, world_size: int) -> tuple[int, int, int, int]:
    """The four degrees with dp_shard = -1 resolved; refuses a product that is not the world size."""
    return pcfg.pp, pcfg.dp_replicate, resolve_dp_shard(pcfg, world_size), pcfg.tp


def build_mesh(pcfg: ParallelConfig) -> DeviceMesh:
    """A 4-D mesh on the default process group (initialized from torchrun's env when needed)."""
    init_distributed()
    shape = mesh_shape(pcfg, dist.get_world_size())
    return init_device_mesh(device_type(), shape, mesh_dim_names=MESH_DIMS)


def dp_rank(mesh: DeviceMesh) -> int:
    """This rank's index over both DP dims, replicate-major like the mesh: which share of a global batch it takes."""
    return mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size() + mesh["dp_shard"].get_local_rank()


def dp_size(mesh: DeviceMesh) -> int:
    """The DP degree over both DP dims: how many shares a global batch is cut into."""
    return mesh["dp_replicate"].size() * mesh["dp_shard"].size()
