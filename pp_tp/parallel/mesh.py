"""The device mesh: ("pp", "dp_replicate", "dp_shard", "tp"), NCCL on CUDA, gloo on CPU.

With context parallel (`parallel.cp` > 1) the mesh is ("pp", "dp_replicate", "dp_shard", "cp", "tp"), "cp" between
data parallel and TP as torchtitan orders it, plus the flattened "dp_shard_cp" = ("dp_shard", "cp") FSDP shards over:
cp ranks hold the same parameters and different tokens, so their gradients are reduced like DP ranks'.

With expert parallel (`parallel.ep` > 1) the EP group is carved out of dp_shard, as torchtitan and Megatron do:
the mesh is ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp") with "dp_shard" the flattened
("dp_shard_mod_ep", "ep"), so everything that reads mesh["dp_shard"] is unchanged; experts are sharded over
"ep" and FSDP-sharded over what EP leaves ("dp_replicate", "dp_shard_mod_ep"). With both, EP spans dp_shard_in_ep
x cp, as torchtitan lays it out: ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp"), "ep" the
flattened ("dp_shard_in_ep", "cp"); experts are still FSDP-sharded over ("dp_replicate", "dp_shard_mod_ep").

The process group comes from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), so one
node and many nodes are the same code path.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pp_tp.base._torch import flatten_mesh_dims, forget_sharding_specs
from pp_tp.base.per_world import once_per_world
from pp_tp.config import ParallelConfig, check_ep, resolve_dp_shard
from pp_tp.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
EP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")
CP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EP_CP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")


def flattened(names: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The flattened dims of the mesh whose own dims are `names`, and the dims each covers."""
    if "dp_shard_in_ep" in names:  # expert and context parallel: EP spans dp_shard_in_ep x cp (torchtitan's layout)
        return {
            "dp_shard": ("dp_shard_mod_ep", "dp_shard_in_ep"),
            "ep": ("dp_shard_in_ep", "cp"),
            "dp_shard_cp": ("dp_shard_mod_ep", "dp_shard_in_ep", "cp"),
        }
    if "ep" in names:
        return {"dp_shard": ("dp_shard_mod_ep", "ep")}
    return {"dp_shard_cp": ("dp_shard", "cp")} if "cp" in names else {}


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
    """The four degrees (pp, dp_replicate, dp_shard, tp) with dp_shard = -1 resolved (cp ranks left out of it);
    refuses a product that is not the world size, or an expert-parallel degree dp_shard cannot hold."""
    dp_shard = resolve_dp_shard(pcfg, world_size)
    check_ep(pcfg.ep, dp_shard, pcfg.cp)
    return pcfg.pp, pcfg.dp_replicate, dp_shard, pcfg.tp


def build_mesh(pcfg: ParallelConfig) -> DeviceMesh:
    """The mesh on the default process group (initialized from torchrun's env when needed)."""
    init_distributed()
    return make_mesh(device_type(), pcfg, dist.get_world_size())


def make_mesh(device: str, pcfg: ParallelConfig, world_size: int) -> DeviceMesh:
    """The 4-D mesh; with parallel.ep > 1 the 5-D one whose flattened "dp_shard" covers ("dp_shard_mod_ep", "ep");
    with parallel.cp > 1 the 5-D one with "cp" and the flattened "dp_shard_cp"; with both, the 6-D one whose
    flattened "ep" covers ("dp_shard_in_ep", "cp") (`flattened`). Made once per shape and default process group
    (`once_per_world`): a later build on the same shape reuses its process groups."""
    pp, dp_replicate, dp_shard, tp = mesh_shape(pcfg, world_size)
    ep, cp = pcfg.ep, pcfg.cp
    if ep > 1 and cp > 1:
        shape, names = (pp, dp_replicate, dp_shard // (ep // cp), ep // cp, cp, tp), EP_CP_MESH_DIMS
    elif cp > 1:
        shape, names = (pp, dp_replicate, dp_shard, cp, tp), CP_MESH_DIMS
    elif ep > 1:
        shape, names = (pp, dp_replicate, dp_shard // ep, ep, tp), EP_MESH_DIMS
    else:
        shape, names = (pp, dp_replicate, dp_shard, tp), MESH_DIMS

    def make() -> DeviceMesh:
        mesh = init_device_mesh(device, shape, mesh_dim_names=names)
        for name, dims in flattened(names).items():
            flatten_mesh_dims(mesh, dims, name)
        return mesh

    return once_per_world(("mesh", device, shape, names), make)


_LAST_BUILT_ON: list[DeviceMesh | None] = [None]  # the mesh of this process's last build


def build_on(mesh: DeviceMesh) -> None:
    """Called by every build before its first DTensor op: DTensor caches an op's output spec, mesh included, under a
    key that compares meshes by ranks and dim names, not by process group, and the "tp" submeshes of pp2 x tp2 and of
    pp1 x dp2 x tp2 over the same ranks are equal. A build after one on the other mesh took 6 of its 7 parameters onto
    the first one's tp group (same ranks, so the same values; test_nonlm's CREDIT after its pp1 x dp2 x tp2 case). So
    a build on another mesh than the last one starts from empty caches."""
    if _LAST_BUILT_ON[0] is not mesh:
        forget_sharding_specs()
        _LAST_BUILT_ON[0] = mesh


def dp_rank(mesh: DeviceMesh) -> int:
    """This rank's index over both DP dims, replicate-major like the mesh: which share of a global batch it takes."""
    return mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size() + mesh["dp_shard"].get_local_rank()


def dp_size(mesh: DeviceMesh) -> int:
    """The DP degree over both DP dims: how many shares a global batch is cut into."""
    return mesh["dp_replicate"].size() * mesh["dp_shard"].size()


def token_groups(mesh: DeviceMesh) -> list[dist.ProcessGroup]:
    """The groups a step's tokens are spread over: the DP ranks, and the cp ranks (each holds part of every
    sequence); those of size 1 left out. ("dp_shard" may be a flattened dim: indexed by name like the others.)"""
    dims = ("dp_replicate", "dp_shard") + (("cp",) if "cp" in (mesh.mesh_dim_names or ()) else ())
    return [mesh.get_group(d) for d in dims if mesh[d].size() > 1]
