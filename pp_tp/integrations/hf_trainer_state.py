"""PipelineTrainer's optimizer, scheduler and RNG states in the files Trainer writes on one process, so a checkpoint
resumes at any layout, and with plain `transformers.Trainer`.

Trainer's `optimizer.pt` numbers the parameters over its two groups (weight decay, then none) in the model's
`named_parameters` order. Here the optimizer has one group per (that class, device mesh) over this rank's stages
(torch's foreach/fused kernels take one mesh per call, as Trainer's own split); each group keeps its class under
`trainer_group`. Saving gathers each state tensor whole (a collective over its mesh) and sends the stages' states
to rank 0, which writes the one-process file; loading reads it on every rank and keeps each parameter's shard.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pp_tp.base.tensors import copy_full_, full_tensor

OPTIMIZER, SCHEDULER, RNG = "optimizer.pt", "scheduler.pt", "rng_state.pth"


def trainer_groups(model: nn.Module, decay: Iterable[str]) -> list[list[str]]:
    """The full model's trainable parameter names in Trainer's two groups (weight decay, none), in its order."""
    decay = set(decay)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return [[n for n in names if n in decay], [n for n in names if n not in decay]]


def param_groups(named: Iterable[tuple[str, nn.Parameter]], decay: set[str], weight_decay: float) -> list[dict]:
    """Trainer's two groups over this rank's parameters, split per device mesh, each tagged with its class."""
    groups: dict[tuple, dict] = {}
    for name, p in named:
        if p.requires_grad:
            cls = 0 if name in decay else 1
            key = (cls, id(p.device_mesh) if isinstance(p, DTensor) else None)
            wd = weight_decay if cls == 0 else 0.0
            groups.setdefault(key, {"params": [], "weight_decay": wd, "trainer_group": cls})["params"].append(p)
    return sorted(groups.values(), key=lambda g: g["trainer_group"])


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "trainer_group")}


def save_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], full: list[list[str]], writer: bool,
                   path: str) -> None:  # fmt: skip
    """Writes `optimizer.pt` as Trainer on one process would (a collective: every rank calls it). `names`: a local
    parameter's id -> its full model name (a tied copy's canonical one); `writer`: whether this rank sends its stages'
    states (one rank per pp stage, coordinate 0 elsewhere)."""
    state: dict[str, dict] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            whole = {
                k: full_tensor(v).cpu() if torch.is_tensor(v) else v for k, v in optimizer.state.get(p, {}).items()
            }
            if writer and whole:
                state.setdefault(names[id(p)], whole)
    hyper = {g["trainer_group"]: _hyper(g) for g in reversed(optimizer.param_groups)} if writer else {}
    parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((state, hyper), parts, dst=0)
    if dist.get_rank() != 0:
        return
    merged, hypers = {}, {}
    for s, h in parts:
        merged.update(s)
        hypers.update(h)
    order = [n for names_ in full for n in names_]
    index = {n: i for i, n in enumerate(order)}
    groups, start = [], 0
    for cls, names_ in enumerate(full):
        groups.append({**hypers.get(cls, hypers.get(1 - cls, {})), "params": list(range(start, start + len(names_)))})
        start += len(names_)
    torch.save({"state": {index[n]: s for n, s in merged.items()}, "param_groups": groups}, path)


def load_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], full: list[list[str]], path: str) -> None:
    """Loads a one-process `optimizer.pt` into this rank's optimizer: each parameter's state, cut to its shard."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    index = {n: i for i, n in enumerate(n for names_ in full for n in names_)}
    state, groups, k = {}, [], 0
    for group in optimizer.param_groups:
        local = []
        for p in group["params"]:
            entry = saved["state"].get(index[names[id(p)]])
            if entry is not None:
                state[k] = {key: _shard_like(p, v) for key, v in entry.items()}
            local.append(k)
            k += 1
        hyper = {key: v for key, v in saved["param_groups"][group["trainer_group"]].items() if key != "params"}
        groups.append({**hyper, "trainer_group": group["trainer_group"], "params": local})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _shard_like(p: torch.Tensor, value: Any) -> Any:
    """A state tensor shaped like its parameter, as this rank's shard of it (a DTensor like the parameter)."""
    if not torch.is_tensor(value) or value.shape != p.shape:
        return value
    out = torch.zeros_like(p, dtype=value.dtype)
    copy_full_(out, value.to(out.device))
    return out


def scheduler_state(state: dict, classes: list[int], to_trainer: bool) -> dict:
    """A scheduler's per-group lists between this optimizer's groups (`classes`: each group's Trainer group) and
    Trainer's two: the first group of each class speaks for it (the schedule is the same for all of a class)."""
    out = dict(state)
    for key, value in state.items():
        if to_trainer and isinstance(value, list) and len(value) == len(classes):
            out[key] = [value[classes.index(c)] if c in classes else value[0] for c in (0, 1)]
        elif not to_trainer and isinstance(value, list) and len(value) == 2:
            out[key] = [value[c] for c in classes]
    return out


def save_rng(path: str) -> None:
    """Rank 0's generators as Trainer's one-process `rng_state.pth` (every rank draws alike)."""
    if dist.get_rank() == 0:
        states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
        torch.save(states, path)


def load_rng(checkpoint: str) -> None:
    """The checkpoint's generators (a one-process file, else rank 0's of a distributed run) on every rank alike,
    so every rank keeps drawing the same sampler order."""
    states = [None]
    if dist.get_rank() == 0:
        for name in (RNG, "rng_state_0.pth"):
            if os.path.isfile(os.path.join(checkpoint, name)):
                states[0] = torch.load(os.path.join(checkpoint, name), weights_only=False)
                break
    dist.broadcast_object_list(states, src=0)
    if states[0] is not None:
        random.setstate(states[0]["python"])
        np.random.set_state(states[0]["numpy"])
        torch.random.set_rng_state(states[0]["cpu"])
