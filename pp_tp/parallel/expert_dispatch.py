"""Dropless token dispatch for one experts module: its own forward runs on this rank's experts only.

Per call (one MoE layer, one microbatch): the routing slots (token, k) are sorted by expert; with expert parallel
one all-gather of the per-expert counts over "ep" (E int64) gives every rank the split sizes, read to the host in
one read (the call's only host sync: the all-to-all takes them as ints), one all-to-all sends each slot's token to
the rank holding its expert and a second brings the expert outputs back (their backward is the two reverse all-to-
alls, so the router's and the tokens' gradients are exact). The routing weights are applied after the return, so
they never cross the network and their gradient is computed where the router is. Under TP of experts the tokens are
already the same on every TP rank: the experts hold a feature shard, their outputs are all-reduced once per call
(slot-level, before the weighting, so the router gradient is whole on every TP rank) and their input gradient once
(Megatron's g and f). No capacity factor, no dropped token: the result is the plain model's up to summation order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from pp_tp.base._torch import all_to_all_single_autograd, swap_parameters, wait_tensor
from pp_tp.base.override import Override


@dataclass
class ExpertDispatch:
    """How one experts module reaches its experts: `n_experts` in all, this rank's contiguous share over `ep`
    (None: all local), feature-sharded over `tp` (None: whole)."""

    n_experts: int
    ep: DeviceMesh | None
    tp: DeviceMesh | None
    # Parameters this rank reads as zeros: whole on every TP rank, their term added to each expert output (the down
    # bias) comes from TP rank 0 only, so the all-reduce counts it once.
    zeroed: tuple[str, ...] = ()

    @property
    def local_experts(self) -> int:
        return self.n_experts // (self.ep.size() if self.ep is not None else 1)

    def __call__(
        self,
        module: nn.Module,
        forward: Callable[..., torch.Tensor],
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        k = top_k_index.shape[-1]
        x = _grad_all_reduce(hidden, self.tp) if self.tp is not None else hidden
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        slots, ids, send, recv = ROUTE()(self, x[token], flat, order)
        ones = torch.ones(ids.shape[0], 1, dtype=top_k_weights.dtype, device=ids.device)
        with local_parameters(module, 1.0 / self.ep.size() if self.ep is not None else 1.0, self.zeroed) as local:
            out = forward(module, slots, ids.unsqueeze(1), ones)
        if self.ep is not None:
            out = _zero_gradient_for_unreached(out, slots, local)
            out = wait_tensor(all_to_all_single_autograd(out, send, recv, self.ep.get_group()))
        if self.tp is not None:
            out = _all_reduce(out, self.tp)
        weights = top_k_weights.reshape(-1)[order].unsqueeze(1).to(out.dtype)
        combined = torch.zeros(hidden.shape[0], out.shape[-1], dtype=out.dtype, device=out.device)
        return combined.index_add(0, token, out * weights).to(hidden.dtype)

    def route(self, slots: torch.Tensor, flat: torch.Tensor, order: torch.Tensor) -> tuple:
        """The `Route` of the routing's values: without expert parallel the slots stay, with it they go to the ranks
        holding their experts (split sizes from one all-gather of the per-expert counts, one host read)."""
        if self.ep is None:
            return slots, flat[order], None, None
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=flat.device)
        counts.index_add_(0, flat, torch.ones_like(flat))  # bincount would read max(flat) to the host on CUDA
        ep, local = self.ep.size(), self.local_experts
        every = torch.empty(ep * self.n_experts, dtype=counts.dtype, device=counts.device)
        dist.all_gather_into_tensor(every, counts, group=self.ep.get_group())
        every = every.view(ep, self.n_experts)
        mine = every[:, self.ep.get_local_rank() * local :][:, :local]  # [source rank, local expert]
        sizes = torch.cat([counts.view(ep, local).sum(1), mine.sum(1)]).tolist()  # the call's one host read
        send, recv = sizes[:ep], sizes[ep:]
        received = wait_tensor(all_to_all_single_autograd(slots, recv, send, self.ep.get_group()))
        ids = torch.arange(local, device=counts.device).repeat(ep)
        ids = ids.repeat_interleave(mine.flatten(), output_size=sum(recv))
        return received, ids, send, recv


# Where a call's slots (sorted by expert) go: (dispatch, slots, flat routing, its sort order) -> (the slots this
# rank's experts get, their local expert ids, send and receive split sizes); a run without values installs its own.
ROUTE = Override(ExpertDispatch.route)


@contextmanager
def local_parameters(
    module: nn.Module, grad_scale: float, zeroed: tuple[str, ...] = ()
) -> Iterator[list[torch.Tensor]]:
    """The module's DTensor parameters read as their local shards while inside (the family's forward indexes
    experts by local id), yielded too; their gradients reach the DTensor parameters times `grad_scale`. Those named
    in `zeroed` read as zeros with their gradient passed through whole (`_ZeroForward`).

    The scale is 1 / ep: FSDP averages expert gradients over the dp / ep ranks holding the same experts while the
    loss is scaled for a mean over all dp ranks (runtime.loss). Not FSDP's set_gradient_divide_factor: on a
    one-rank group torch 2.13 divides by it twice (_fsdp_collectives.foreach_reduce)."""
    local = {n: p.to_local() for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    if grad_scale != 1.0:
        for t in local.values():
            if t.requires_grad:
                t.register_hook(lambda g: g * grad_scale)
    read = {n: _ZeroForward.apply(t) if n in zeroed else t for n, t in local.items()}
    saved = swap_parameters(module, read)
    try:
        yield list(read.values())
    finally:
        swap_parameters(module, saved)


class _ZeroForward(torch.autograd.Function):
    """Zeros forward, the gradient passed through: a TP rank other than 0 reads the down bias as zeros, so the
    all-reduced outputs hold it once, while every TP rank's bias gradient is the whole one (the same all-reduced
    output gradient reaches each), as its Replicate placement requires."""

    @staticmethod
    def forward(ctx: object, t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _zero_gradient_for_unreached(out: torch.Tensor, slots: torch.Tensor, local: list[torch.Tensor]) -> torch.Tensor:
    """`out`, joined by a zero-valued term to each local parameter the experts' forward did not use (no slot for
    them on this rank), so every rank still gives them a (zero) gradient, as the plain model does, and reduces and
    steps them.

    Only unused parameters are joined, each reaching the graph through that one node: a split backward
    (zero-bubble schedules, torch's stage_backward_input / stage_backward_weight) groups parameters by the nodes
    where they meet the input's gradient path, and a node shared with parameters that meet it elsewhere too
    yields overlapping groups (measured on torch 2.13: "Trying to backward through the graph a second time").
    The walk stops at the slots, so it stays within this call's expert computation."""
    wanted = {t.grad_fn: t for t in local if t.grad_fn is not None}
    todo, seen = [out.grad_fn], {slots.grad_fn}
    while todo and wanted:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if wanted.pop(node, None) is None:
            todo.extend(fn for fn, _ in node.next_functions)
    unused = list(wanted.values())
    return out + sum(t.flatten()[0] * 0 for t in unused) if unused else out


def _grad_all_reduce(x: torch.Tensor, tp: DeviceMesh) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient over `tp` (Megatron's f), through DTensor."""
    return DTensor.from_local(x, tp, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))


def _all_reduce(x: torch.Tensor, tp: DeviceMesh) -> torch.Tensor:
    """All-reduce over `tp` forward, identity backward (Megatron's g), through DTensor."""
    return DTensor.from_local(x, tp, (Partial(),), run_check=False).redistribute(tp, (Replicate(),)).to_local()
