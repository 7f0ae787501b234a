"""Saved activations: the live bytes autograd holds for backward, and one stage's microbatch of them."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from pp_tp.base._torch import TorchDispatchMode, local_tensor, storage_id
from pp_tp.config import ParallelConfig
from pp_tp.parallel.activation_checkpoint import is_checkpointed
from pp_tp.parallel.context_parallel import ContextParallel
from pp_tp.runtime.loss import TokenSumLoss
from pp_tp.stages.stage_module import StageModule


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return local_tensor(t).untyped_storage()


def _keys(tree: Any) -> set[int]:
    """Storage ids of the tensors in an op's arguments or outputs (tuples, lists and dicts of them)."""
    if isinstance(tree, torch.Tensor):
        return {storage_id(_storage(tree))}
    if isinstance(tree, (tuple, list)):
        return set().union(*map(_keys, tree)) if tree else set()
    if isinstance(tree, dict):
        return _keys(list(tree.values()))
    return set()


class _Held:
    """What autograd keeps for one saved tensor; its finalizer tells SavedActivations it was dropped."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedActivations:
    """Live bytes autograd holds for backward while the `with` block runs (and after, until freed).

    Counted: tensors saved for backward, and the inputs of activation-checkpointed modules (what a
    checkpoint keeps to recompute from; what it saves inside is not held). Each storage counts once;
    the module's parameters and buffers (and views of them) are not activations. A tensor is released
    when autograd drops it (its graph is freed), so `peak` is the most held at once: over one forward,
    everything it saved; over a pipeline step, the schedule's peak. Home-made: torch's memory trackers
    are private (torch.distributed._tools) and count every allocation, not what autograd keeps.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage id -> [bytes, holders alive]
        self.inside = False  # set by the caller while a module of interest runs (stage_activation_bytes)
        self.saved_by: tuple[set[int], set[int]] = (set(), set())  # storage ids saved outside it, inside it
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)
        self._handles: list = []
        self.inputs: list[dict[int, int]] = []  # per checkpointed module call, its tensor arguments' storages: bytes

    def _track(self, t: torch.Tensor, holder: object) -> None:
        """Counts `t`'s storage until `holder` is garbage-collected."""
        storage = _storage(t)
        key = storage_id(storage)
        self.saved_by[self.inside].add(key)
        if key in self._refs:
            self._refs[key][1] += 1
        elif key not in {storage_id(_storage(x)) for x in (*self.module.parameters(), *self.module.buffers())}:
            self._refs[key] = [storage.nbytes(), 1]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            return
        weakref.finalize(holder, self._release, key)

    def _pack(self, t: torch.Tensor) -> _Held:
        holder = _Held(t)
        self._track(t, holder)
        return holder

    def _checkpoint_inputs(self, module: nn.Module, args: tuple) -> None:
        self.inputs.append({storage_id(_storage(a)): _storage(a).nbytes() for a in args if isinstance(a, torch.Tensor)})
        for a in args:
            if isinstance(a, torch.Tensor):
                self._track(a, a)

    def held(self, keys: set[int], where: int | None = None) -> int:
        """Bytes of the storages among `keys` held now; `where` 0 or 1: only those saved outside or inside the
        module of interest."""
        kept = keys if where is None else keys & self.saved_by[where]
        return sum(ref[0] for k, ref in self._refs.items() if k in kept)

    def _release(self, key: int) -> None:
        ref = self._refs[key]
        ref[1] -= 1
        if ref[1] == 0:
            self.live -= ref[0]
            del self._refs[key]

    def __enter__(self) -> Self:
        self._handles = [
            m.register_forward_pre_hook(self._checkpoint_inputs) for m in self.module.modules() if is_checkpointed(m)
        ]
        self._saved_hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._saved_hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()


class _Allocated(TorchDispatchMode):
    """Storages that ops allocate while it is active: an output's storage that none of the op's inputs had (a view
    or an in-place op allocates nothing). Home-made: torch has no public record of what a forward allocated."""

    def __init__(self):
        super().__init__()
        self.keys: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.keys |= _keys(out) - _keys((args, kwargs))
        return out


@dataclass(frozen=True)
class Saved:
    """What one microbatch through a stage keeps for backward (`act`), and what the backward's recompute of its
    first checkpointed module saves on top (`recompute`).

    When that module is a whole block (full AC), `fresh` splits what its recompute still holds at its end by
    storages the block allocated itself (not its inputs, nor tables or masks other blocks share): (all of them,
    those saved by an op outside the block's attention module, those saved by one inside it). Every block of its
    kind allocates and saves as much when it runs without checkpointing, so these bound from below what each
    block adds under AC "none" and "selective" (pp_tp.planner.stage_costs.StageCostCache.floor)."""

    act: int
    recompute: int = 0
    fresh: tuple[int, int, int] = (0, 0, 0)
    first_block: int = 0  # the most held by the end of the stage's first block (what that block alone holds)
    block_input: int = 0  # under full AC, what the first block's checkpoint keeps that the stage did not hand it


def _attention(block: nn.Module, name: str) -> nn.Module | None:
    try:
        return block.get_submodule(name)
    except AttributeError:
        return None  # no such module: nothing is saved "inside" it


def _recompute(stage: StageModule, module: nn.Module, args: tuple, kwargs: dict) -> Saved:
    """Runs the checkpointed `module`'s own forward again, as backward does, and what it saves (Saved, act 0)."""
    owner = next((b for b in stage.block_modules() if any(m is module for m in b.modules())), None)
    fsdp = owner if isinstance(owner, FSDPModule) else None
    attention = _attention(module, stage.layout.attention) if module is owner else None
    checkpointed_forward, module.forward = module.forward, module.forward.__wrapped__
    hooks = []
    try:
        if fsdp is not None:
            fsdp.unshard()  # the block's parameters are gathered in backward, as here
        with SavedActivations(stage) as again, _Allocated() as allocated:
            if attention is not None:
                hooks = [
                    attention.register_forward_pre_hook(lambda *_: setattr(again, "inside", True)),
                    attention.register_forward_hook(lambda *_: setattr(again, "inside", False)),
                ]
            held = module(*args, **kwargs)  # noqa: F841  (kept: what it saved is counted while it lives)
            fresh = tuple(again.held(allocated.keys, where) for where in (None, 0, 1)) if module is owner else None
    finally:
        module.forward = checkpointed_forward
        for h in hooks:
            h.remove()
        if fsdp is not None:
            fsdp.reshard()
    return Saved(0, again.peak, fresh or (0, 0, 0))


def stage_activation_bytes(
    stage: StageModule, mesh: DeviceMesh, pcfg: ParallelConfig, microbatch: int, seq: int, dim: int
) -> Saved:
    """Saved activations of one microbatch of `seq`-token sequences through `stage` (and its loss, on the last
    stage), and what the backward's recompute of one checkpointed module saves on top (Saved), on fake tensors.

    Under context parallel the stage runs as a cp rank runs it: its seq / cp head-tail tokens and their position
    ids; the fake process group's K/V all-gather returns the whole sequence's keys and values (shapes only), so
    what attention saves of them is measured with the rest."""
    local = seq // pcfg.cp
    cpu = torch.device("cpu")
    positions = {"position_ids": ContextParallel(mesh).local_positions(microbatch, seq, cpu)} if pcfg.cp > 1 else {}
    act_dtype = torch.bfloat16 if pcfg.mixed_precision == "bf16" else torch.float32
    if any(t.device.type == "meta" for t in (*stage.parameters(), *stage.buffers())):
        # once only: a second to_empty would swap parameters a previous measurement's autograd still references
        stage.to_empty(device="cpu")
    if stage.is_first:
        x = torch.zeros(microbatch, local, dtype=torch.long)
    else:
        x = torch.empty(microbatch, local, dim, dtype=act_dtype, requires_grad=True)
    calls: list = []
    checkpointed = [m for m in stage.modules() if is_checkpointed(m)][:1]
    hooks = [  # prepended: the module's own inputs, before TP's input hooks turn them into DTensors
        m.register_forward_pre_hook(lambda m, a, k: calls.append((m, a, k)), with_kwargs=True, prepend=True)
        for m in checkpointed
    ]
    ends: list[int] = []
    hooks += [b.register_forward_hook(lambda *_: ends.append(saved.peak)) for b in stage.block_modules()[:1]]
    with SavedActivations(stage) as saved:
        out = stage(x, **positions)
        if stage.is_last:
            labels = torch.zeros(microbatch, local, dtype=torch.long)
            loss = TokenSumLoss(mesh["tp"] if pcfg.loss_parallel and pcfg.tp > 1 else None)
            with loss.parallel():
                loss(out, labels)
    for h in hooks:
        h.remove()
    again = _recompute(stage, *calls[0]) if calls else Saved(0)
    block_input = 0
    if calls and calls[0][0] is stage.block_modules()[0]:  # full AC: the first block is checkpointed whole
        # its own copies (its hidden state, FSDP's casts of the tables), not the tables the stage hands every block
        shared = _keys(calls[0][1][1:]) | _keys(calls[0][2]) | _keys([*stage.parameters(), *stage.buffers()])
        block_input = sum(size for key, size in saved.inputs[0].items() if key not in shared)
    return Saved(saved.peak, again.recompute, again.fresh, ends[0] if ends else 0, block_input)
