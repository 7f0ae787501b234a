"""Saved activations: the live bytes autograd holds for backward, and one stage's microbatch of them."""

from __future__ import annotations

import weakref
from typing import Self

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from pp_tp.base._torch import local_tensor, storage_id
from pp_tp.config import ParallelConfig
from pp_tp.parallel.activation_checkpoint import is_checkpointed
from pp_tp.parallel.context_parallel import ContextParallel
from pp_tp.runtime.loss import TokenSumLoss
from pp_tp.stages.stage_module import StageModule


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return local_tensor(t).untyped_storage()


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
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)
        self._handles: list = []

    def _track(self, t: torch.Tensor, holder: object) -> None:
        """Counts `t`'s storage until `holder` is garbage-collected."""
        storage = _storage(t)
        key = storage_id(storage)
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
        for a in args:
            if isinstance(a, torch.Tensor):
                self._track(a, a)

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


def stage_activation_bytes(
    stage: StageModule, mesh: DeviceMesh, pcfg: ParallelConfig, microbatch: int, seq: int, dim: int
) -> tuple[int, int]:
    """(saved activations of one microbatch of `seq`-token sequences through `stage` (and its loss, on the last
    stage), what the backward's recompute of one checkpointed module saves on top), on fake tensors.

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
    with SavedActivations(stage) as saved:
        out = stage(x, **positions)
        if stage.is_last:
            labels = torch.zeros(microbatch, local, dtype=torch.long)
            loss = TokenSumLoss(mesh["tp"] if pcfg.loss_parallel and pcfg.tp > 1 else None)
            with loss.parallel():
                loss(out, labels)
    for h in hooks:
        h.remove()
    recompute = 0
    if calls:  # backward runs the module's own forward again, saving what it saves without checkpointing
        module, args, kwargs = calls[0]
        owner = next((b for b in stage.block_modules() if any(m is module for m in b.modules())), None)
        fsdp = owner if isinstance(owner, FSDPModule) else None
        checkpointed_forward, module.forward = module.forward, module.forward.__wrapped__
        try:
            if fsdp is not None:
                fsdp.unshard()  # the block's parameters are gathered in backward, as here
            with SavedActivations(stage) as again:
                module(*args, **kwargs)
        finally:
            module.forward = checkpointed_forward
            if fsdp is not None:
                fsdp.reshard()
        recompute = again.peak
    return saved.peak, recompute
