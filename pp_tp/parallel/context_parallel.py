"""Context parallel (`parallel.cp`): each sequence split over the cp ranks, attention over the whole of it.

torch's own `context_parallel` intercepts only the CUDA SDPA kernels and FlexAttention has no CPU backward, so
this is pp_tp's own, the design Llama 3's long-context training used: every cp rank holds two chunks of each
sequence, i and 2cp-1-i of 2cp equal ones (head-tail, so causal attention costs every rank the same), for inputs,
labels and position ids alike (`shard`, `local_positions`, run by `Pipeline.step`); stage boundaries carry the
rank's `[B, S/cp, D]`. In every attention layer K and V are all-gathered over cp (`gather`: its backward sums the
gradients of every rank's queries and keeps this rank's slice). Plain causal layers then run fused blocks with no
mask (`causal_attention`, pp_tp/parallel/cp_attention_blocks.py); the others (sliding windows, packed documents,
eager functions) run the family's own attention on the local queries against all keys under the boolean mask of
those positions (`mask`, `attention_mask`), handed over as one float mask per step shared by the layers
(`additive`).

An attention module opts in by declaring a `context_parallel` attribute (the reference model's `Attention`), or a
family registers an installer (`register_cp_attention`: Hugging Face models, pp_tp/models/hf/cp_attention.py).
What cannot run exactly under cp is refused in one line before any collective: the model's rules in preflight
(`check_cp_model`), an attention module nothing can install in the local build.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.base._torch import sdpa_lse_kernel
from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.layout import ModelLayout
from pp_tp.parallel.cp_attention_blocks import causal_blocks
from pp_tp.parallel.rng import active_dropout

# Installers: (attention module, ContextParallel) -> True when they made the module gather K/V over cp.
_INSTALLERS: list[Callable[[nn.Module, ContextParallel], bool]] = []


def register_cp_attention(install: Callable[[nn.Module, ContextParallel], bool]) -> None:
    """Teaches context parallel a family's attention modules; later registrations are tried first."""
    _INSTALLERS.insert(0, install)


class _GatherSequence(torch.autograd.Function):
    """All-gather along a sequence dim, rank-major or in sequence order (`ordered`: each rank's head and tail chunks
    put back where they belong); backward: each rank's slice of the gradient summed over cp."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, cp: ContextParallel, ordered: bool) -> torch.Tensor:
        ctx.dim, ctx.cp, ctx.ordered = dim, cp, ordered
        out = x.new_empty((cp.size * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=cp.group)
        ranks = out.chunk(cp.size)
        if not ordered:
            return torch.cat(ranks, dim=dim)
        halves = [r.chunk(2, dim=dim) for r in ranks]
        return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        cp = ctx.cp
        if ctx.ordered:  # sequence order back to rank-major: rank r's chunks r and 2cp-1-r
            chunks = grad.chunk(2 * cp.size, dim=ctx.dim)
            parts = torch.cat([torch.cat([chunks[r], chunks[-1 - r]], dim=ctx.dim) for r in range(cp.size)])
        else:
            parts = torch.cat(grad.chunk(cp.size, dim=ctx.dim))  # rank-major along dim 0
        if dist.get_backend(cp.group) == "nccl":
            out = parts.new_empty((parts.shape[0] // cp.size, *parts.shape[1:]))
            dist.reduce_scatter_single(out, parts, group=cp.group)
            return out, None, None, None
        dist.all_reduce(parts, group=cp.group)  # gloo has no reduce-scatter
        return parts.chunk(cp.size)[cp.rank].contiguous(), None, None, None


class ContextParallel:
    """This rank's place in its cp group: the head-tail chunks it holds, the K/V all-gather and the masks."""

    def __init__(self, mesh: DeviceMesh):
        self.group = mesh.get_group("cp")
        self.size = mesh["cp"].size()
        self.rank = mesh.get_local_rank("cp")
        self._masks: dict[tuple, torch.Tensor] = {}
        self._documents = False
        self._document_masks: tuple[torch.Tensor, int | None, torch.Tensor] | None = None
        self._additive: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def documents(self) -> bool:
        """Whether this step's rows pack documents (set by Pipeline for the whole step, so a forward recomputed in
        backward masks alike); then masks follow the position ids (`attention_mask`), at one all-gather of them."""
        return self._documents

    @documents.setter
    def documents(self, packed: bool) -> None:
        self._documents = packed
        self._additive.clear()  # a new step: its float masks are built afresh (`additive`)

    def additive(self, allowed: torch.Tensor, dtype: torch.dtype, fill: float, window: int | None) -> torch.Tensor:
        """The boolean mask `allowed` as the float one attention adds to its scores (0 where allowed, `fill` where
        not: -inf is what SDPA makes of a boolean mask), built once and shared by every layer of this `window` that
        passes the same boolean mask in this step. SDPA would otherwise convert it in every layer and save each
        float copy for backward; a shared one is one storage however many layers save it."""
        key = (window, dtype, fill)
        hit = self._additive.get(key)
        if hit is None or hit[0] is not allowed:
            hit = (allowed, torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, fill))
            self._additive[key] = hit
        return hit[1]

    def chunk_positions(self, seq: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
        """The global positions cp rank `rank` holds of a `seq`-long sequence: chunks rank and 2cp-1-rank."""
        c = seq // (2 * self.size)
        tail = 2 * self.size - 1 - rank
        return torch.cat(
            [
                torch.arange(rank * c, (rank + 1) * c, device=device),
                torch.arange(tail * c, (tail + 1) * c, device=device),
            ]
        )

    def check_seq(self, where: str, seq: int) -> None:
        """Whole head-tail chunks: the sequence must divide into 2cp equal ones."""
        if seq % (2 * self.size):
            raise ConfigError(
                f"{where}: seq {seq} is not divisible by 2 * parallel.cp = {2 * self.size}; use a sequence length "
                f"that is a multiple of {2 * self.size}"
            )

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's two chunks of `t` [B, S, ...] along dim 1, in order (head, then tail)."""
        chunks = t.chunk(2 * self.size, dim=1)
        return torch.cat([chunks[self.rank], chunks[2 * self.size - 1 - self.rank]], dim=1)

    def local_positions(self, batch: int, seq: int, device: torch.device) -> torch.Tensor:
        """Position ids [batch, seq / cp] of this rank's tokens in their sequences (rotary tables, masks)."""
        return self.chunk_positions(seq, self.rank, device).expand(batch, -1)

    def gather(self, t: torch.Tensor, dim: int, ordered: bool = False) -> torch.Tensor:
        """Every cp rank's `t` concatenated along the sequence dim `dim`: rank-major (keys: `mask`'s columns), or
        in sequence order (`ordered`, what `causal_attention` reads)."""
        return _GatherSequence.apply(t, dim, self, ordered)

    def fused(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether `causal_attention` runs queries `q` [B, H, S/cp, D] and keys `k` [B, Hkv, S/cp, D] on a fused
        kernel (pp_tp.base._torch.sdpa_lse_kernel); else a caller keeps the masked path."""
        return sdpa_lse_kernel(q, k.shape[1]) is not None

    def causal_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        """Causal attention [B, H, S/cp, D] of this rank's queries over the whole sequence, no mask built: K and V
        [B, Hkv, S/cp, D] all-gathered in sequence order, each head-tail chunk by two fused blocks merged exactly by
        their log-sum-exp (pp_tp/parallel/cp_attention_blocks.py). Grouped heads and `scale` as SDPA takes them."""
        k, v = self.gather(k, 2, ordered=True), self.gather(v, 2, ordered=True)
        return causal_blocks(q, k, v, (self.rank, 2 * self.size - 1 - self.rank), scale)

    def mask(self, local: int, device: torch.device, window: int | None = None) -> torch.Tensor:
        """Boolean [local, cp * local]: this rank's queries (rows, its head-tail positions) against the gathered
        keys (columns, rank-major): causal, and inside `window` where given (key > query - window, transformers'
        sliding_window_overlay). Cached: it depends on the shapes only."""
        key = (local, device, window)
        if key not in self._masks:
            seq = local * self.size
            q = self.chunk_positions(seq, self.rank, device)[:, None]
            k = torch.cat([self.chunk_positions(seq, r, device) for r in range(self.size)])[None, :]
            allowed = k <= q
            self._masks[key] = allowed & (k > q - window) if window is not None else allowed
        return self._masks[key]

    def held_bytes(self) -> int:
        """Bytes of the masks this rank keeps cached across steps (the planner counts them)."""
        return sum(m.nbytes for m in self._masks.values())

    def attention_mask(
        self, local: int, device: torch.device, window: int | None, position_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """Boolean [B or 1, 1, local, cp * local] for this rank's queries against the gathered keys: `mask`, and
        with packed documents (`documents`) each query kept inside its own document. A document is where global
        index minus position id is constant (a new one starts where a position does not follow the previous one,
        as transformers reads packed position ids), so gathering every rank's `position_ids` [B, local] is all it
        takes; once per microbatch (cached on the tensor the stage's blocks share)."""
        allowed = self.mask(local, device, window)[None, None]
        if not self.documents:
            return allowed
        if position_ids is None:
            raise ConfigError(
                "packed documents under parallel.cp > 1: an attention layer was called without position_ids, so pp_tp "
                "cannot keep its queries inside their documents; set data.document_mask = false or parallel.cp = 1"
            )
        cached = self._document_masks
        if cached is not None and cached[0] is position_ids and cached[1] == window:
            return cached[2]
        starts = self.chunk_positions(local * self.size, self.rank, device) - position_ids  # [B, local]
        every = starts.new_empty((self.size * starts.shape[0], local))
        dist.all_gather_single(every, starts.contiguous(), group=self.group)
        keys = torch.cat(every.chunk(self.size), dim=1)  # [B, cp * local], rank-major like gathered keys
        mask = allowed & (starts[:, None, :, None] == keys[:, None, None, :])
        self._document_masks = (position_ids, window, mask)
        return mask


def _install(attention: nn.Module, cp: ContextParallel) -> bool:
    """An attention module that declares `context_parallel` reads it itself; else a registered installer."""
    if hasattr(type(attention), "context_parallel"):
        attention.context_parallel = cp
        return True
    return any(install(attention, cp) for install in _INSTALLERS)


def check_cp_model(model: nn.Module, layout: ModelLayout, pcfg: ParallelConfig, custom_loss: bool) -> None:
    """What the model must be to run exactly under cp (parallel.cp > 1): a language model taking per-token
    positions, no caller's loss (it would see one cp rank's tokens), no active dropout (its streams are not forked
    per cp rank). One line each; run by preflight, so `pp-tp check` and the planner agree."""
    if pcfg.cp == 1:
        return
    why = None
    if not layout.is_lm or layout.document_block_inputs is None:
        why = f"the {layout.name!r} model layout takes no per-token positions (document_block_inputs)"
    elif custom_loss:
        why = "a caller's loss_fn sees only this cp rank's tokens"
    elif missing := _without_attention(model, layout):
        why = f"block {missing} has no {layout.attention!r} attention to gather (a linear-attention or SSM mixer)"
    elif active_dropout(model):
        why = "active dropout is not forked per cp rank; set the model's dropout rates to 0"
    if why:
        raise ConfigError(f"parallel.cp > 1: {why}; set parallel.cp = 1")


def _without_attention(model: nn.Module, layout: ModelLayout) -> str | None:
    """The first block (FQN) without the layout's attention module: its mixer has no keys and values to gather."""
    for i, block in enumerate(model.get_submodule(layout.blocks).children()):
        try:
            block.get_submodule(layout.attention)
        except AttributeError:
            return f"{layout.blocks}.{i}"
    return None


def apply_context_parallel(stage: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig) -> bool:
    """Makes every local block's attention gather K and V over cp (cp > 1); refuses what cannot run under cp."""
    if pcfg.cp == 1:
        return False
    cp = ContextParallel(mesh)
    stage.context_parallel = cp  # Pipeline sets its `documents` per step; layouts' document masks read it
    for block in stage.block_modules():
        attention = block.get_submodule(stage.layout.attention)
        if not _install(attention, cp):
            raise ConfigError(
                f"parallel.cp = {pcfg.cp}: the {type(attention).__name__} attention of the {stage.layout.name!r} "
                "layout cannot gather keys and values over cp; set parallel.cp = 1"
            )
    return True
