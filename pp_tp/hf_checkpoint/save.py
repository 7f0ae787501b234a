"""`Pipeline.save_pretrained`: an HF-format directory that `AutoModelForCausalLM.from_pretrained` loads.

MoE experts are written in the layout the family's `from_pretrained` reads (per expert where that is the published
format): the names and shapes of transformers' own reverse conversion (`conversion.Reverter`), and a packed expert
tensor gathered one expert at a time (`per_expert.py`), so no rank ever holds a whole packed tensor. Each pp rank
writes the files of its own stages (its rank at dp/ep/tp coordinate 0 writes; its peers only help assemble full
tensors or experts from TP/EP/FSDP shards, one at a time), so no rank ever holds the whole model: the most a writer
holds is one file (`max_shard_size`) and one expert, and a whole tensor is gathered by `base.whole_tensor` (the
tensor plus at most one shard beside it, where DTensor's `full_tensor` held 2.5x). File numbers come from one
`all_gather_object` of every writer's file plan; rank 0 writes the index, config.json and generation_config.json.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.base.tensors import persistent_buffers
from pp_tp.base.whole_tensor import whole_tensor
from pp_tp.errors import ConfigError
from pp_tp.hf_checkpoint.conversion import Reverter
from pp_tp.hf_checkpoint.per_expert import Unit, expert_dims, gather_expert, local_positions, units, write_expert
from pp_tp.hf_checkpoint.source import INDEX, SINGLE

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "5GB", "200MB", "1GiB"."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
    if not m or m.group(2).upper() not in _UNITS:
        raise ConfigError(f"max_shard_size = {size!r} is not a size; give bytes or e.g. '5GB', '500MB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def owned_tensors(parts: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """(checkpoint key, tensor) this pp rank stores: every parameter (a tied copy only where its canonical name
    lives) and persistent buffer (one under a module every stage shares only with the first stage)."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        keys = part.checkpoint_keys
        for name, p in part.named_parameters():
            key = keys[name]
            if name == key or key in keys:
                out.setdefault(key, p)
        shared = tuple(f"{s}." for s in part.layout.shared)
        for name, b in persistent_buffers(part).items():
            if part.is_first or not name.startswith(shared):
                out.setdefault(name, b)
    return list(out.items())


def _stored(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `t` is written in: `dtype` for floating-point tensors when given, else its own (integer buffers)."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _plan_files(planned: list[Unit], sizes: list[int], max_bytes: int) -> list[list[Unit]]:
    """Units grouped into files of at most `max_bytes` written (a bigger unit gets a file of its own); `sizes`: the
    bytes each unit writes (all its on-disk tensors)."""
    files: list[list[Unit]] = []
    size = 0
    for unit, n in zip(planned, sizes):
        if not files or (size + n > max_bytes and files[-1]):
            files.append([])
            size = 0
        files[-1].append(unit)
        size += n
    return files


def _disk_plan(owned, reverter: Reverter, dtype, dims: dict[str, int]) -> tuple[list[Unit], list[int], str | None]:
    """(the units written, the bytes each writes, the refusal if any): transformers' reverse conversion of every
    owned tensor (per expert where that is the published format), packed experts split per expert."""
    try:
        disk = reverter.plan((key, tuple(p.shape), _stored(p, dtype)) for key, p in owned)
    except ConfigError as e:
        return [], [], str(e)
    planned, sizes = [], []
    for key, p in owned:
        stored = _stored(p, dtype)
        for unit in units(key, tuple(p.shape), stored, disk[key], dims.get(key), reverter):
            planned.append(unit)
            sizes.append(unit.nbytes(stored.itemsize))
    return planned, sizes, None


def _is_writer(mesh: DeviceMesh) -> bool:
    """Coordinate 0 of every dim but pp writes its pp rank's files (cp ranks hold the same parameters, as dp's do)."""
    return all(mesh.get_local_rank(d) == 0 for d in mesh.mesh_dim_names if d != "pp")


def _file_names(plans: list[tuple[int, list[list[str]]]]) -> dict[int, list[str]]:
    """pp rank -> its files' names, numbered across all pp ranks in pp order."""
    total = sum(len(files) for _, files in plans)
    names, i = {}, 0
    for pp_rank, files in sorted(plans):
        names[pp_rank] = []
        for _ in files:
            i += 1
            names[pp_rank].append(SINGLE if total == 1 else f"model-{i:05d}-of-{total:05d}.safetensors")
    return names


def _write_metadata(path: str, plans, names, sizes: int, config, source_dir: str | None, dtype) -> None:
    """Rank 0: the index (when sharded), config.json (the weights are written dequantized), and the source's
    generation_config.json."""
    weight_map = {k: n for pp, files in plans for keys, n in zip(files, names[pp]) for k in keys}
    if len(set(weight_map.values())) > 1:
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": sizes}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    if config is not None:
        config = copy.deepcopy(config)
        config.dtype = dtype
        if getattr(config, "quantization_config", None) is not None:
            del config.quantization_config
        config.save_pretrained(path)
    gen = os.path.join(source_dir or "", "generation_config.json")
    if source_dir and os.path.isfile(gen):
        shutil.copyfile(gen, os.path.join(path, "generation_config.json"))


def _clear(path: str) -> None:
    """Removes an earlier save's weights so no stale shard or index survives next to the new ones."""
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if name.endswith(".safetensors") or name == INDEX:
            os.remove(os.path.join(path, name))


def save_pretrained(
    parts: list[nn.Module],
    mesh: DeviceMesh,
    path: str,
    config=None,
    source_dir: str | None = None,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
) -> None:
    """Writes the pipeline's full model to `path` in HF format; every rank calls it (a collective).

    `dtype`: the stored dtype (default: the parameters' own, fp32 master weights); `config`: the model's HF
    config (config.json); `source_dir`: the checkpoint it was loaded from (its generation_config.json is kept).
    """
    from safetensors.torch import save_file

    max_bytes = parse_size(max_shard_size)
    owned = owned_tensors(parts)
    reverter = Reverter(config)
    planned, sizes_of, refusal = _disk_plan(owned, reverter, dtype, expert_dims(parts))
    files = _plan_files(planned, sizes_of, max_bytes) if refusal is None else []
    writer = _is_writer(mesh)
    plans: list = [None] * dist.get_world_size()
    disk_files = [[n for unit in units_ for n in unit.disk] for units_ in files]
    mine = (mesh.get_local_rank("pp"), disk_files, sum(sizes_of), refusal)
    dist.all_gather_object(plans, mine if writer or refusal else None)
    refusals = [p[3] for p in plans if p is not None and p[3]]
    if refusals:  # every rank refuses together, with the lowest refusing rank's line
        raise ConfigError(refusals[0])
    if dist.get_rank() == 0:
        _clear(path)
    dist.barrier()
    sizes = sum(p[2] for p in plans if p is not None)
    plans = [p[:2] for p in plans if p is not None]
    names = _file_names(plans)[mesh.get_local_rank("pp")]
    params = dict(owned)
    for units_, name in zip(files, names):
        tensors: dict[str, torch.Tensor] = {}
        for unit in units_:  # every rank of this pp rank gathers in the same order; only the writer keeps it
            _gather_unit(unit, params[unit.key].detach(), _stored(params[unit.key], dtype), reverter, tensors, writer)
        if writer:
            save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
    if dist.get_rank() == 0:
        first = dtype or (owned[0][1].dtype if owned else torch.float32)
        _write_metadata(path, plans, _file_names(plans), sizes, config, source_dir, first)
    dist.barrier()


def _gather_unit(unit: Unit, t: torch.Tensor, stored: torch.dtype, reverter: Reverter, out: dict, writer: bool) -> None:
    """Gathers what `unit` writes (a whole tensor, or its experts one at a time) and, on the writer, puts its
    on-disk tensors into `out`."""
    if unit.dim is None:
        full = whole_tensor(t).to(stored)
        if writer:
            out.update({k: v.contiguous() for k, v in reverter.convert(unit.key, full).items()})
        return
    positions = local_positions(t, unit.dim)
    for e in unit.experts:
        expert = gather_expert(t, unit.dim, e, positions).to(stored)
        if writer:
            write_expert(unit, e, expert, out)
