"""Causal attention of a cp rank's head-tail chunks against the whole sequence, exact, with no mask at all.

A cp rank holds chunks g = rank and g = 2cp-1-rank of 2cp equal ones. Causal attention of chunk g's queries is
the chunks before it, all visible (one mask-free kernel call over the key prefix [0, g c)), and its own chunk,
lower-triangular (one `is_causal` call on the square diagonal block): two fused-kernel calls, merged exactly by
their log-sum-exp (out = sum_j exp(lse_j - lse) out_j, lse = logaddexp of the blocks'). In backward every block's
kernel backward runs with the merged output and log-sum-exp of its rows, which is the exact gradient of the merged
attention (the softmax's row terms are the merged ones), as torch's ring attention does. So no [S/cp, S] mask or
score tensor exists: what is saved is q, the gathered K and V (in global order), the output and the log-sum-exp.

Home-made: torch's context_parallel intercepts only CUDA SDPA and runs a ring; FlexAttention has no CPU backward.
"""

from __future__ import annotations

from typing import Any

import torch

from pp_tp.base._torch import sdpa_backward_with_lse, sdpa_with_lse


def _blocks(starts: tuple[int, ...], c: int) -> list[tuple[int, int, int, bool]]:
    """(local chunk, key start, key end, causal) of every kernel call: each chunk's visible prefix, then its
    diagonal block."""
    calls = []
    for i, g in enumerate(starts):
        if g:
            calls.append((i, 0, g * c, False))
        calls.append((i, g * c, (g + 1) * c, True))
    return calls


class _CausalBlocks(torch.autograd.Function):
    """q [B, H, n c, D] (chunks at global chunk indices `starts`), k and v [B, Hkv, S, D] in global order."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: tuple, scale: Any) -> torch.Tensor:
        c = q.shape[2] // len(starts)
        calls = _blocks(starts, c)
        merged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        states = []
        for i, k0, k1, causal in calls:
            out, lse, state = sdpa_with_lse(q[:, :, i * c : (i + 1) * c], k[:, :, k0:k1], v[:, :, k0:k1], causal, scale)
            states.append(state)
            if i not in merged:
                merged[i] = (out, lse)
                continue
            out0, lse0 = merged[i]
            both = torch.logaddexp(lse0, lse)
            acc = torch.promote_types(lse.dtype, out.dtype)
            mix = out0.to(acc) * (lse0 - both).exp()[..., None] + out.to(acc) * (lse - both).exp()[..., None]
            merged[i] = (mix.to(out.dtype), both)
        b, h, n, d = q.shape
        # [B, S/cp, H, D] in memory, as SDPA's own output: the caller's transpose back to tokens is then a view, so
        # the output projection saves this same storage rather than a copy
        out = q.new_empty(b, n, h, v.shape[-1]).transpose(1, 2)
        for i, (block, _) in merged.items():
            out[:, :, i * c : (i + 1) * c] = block
        lse = torch.cat([merged[i][1] for i in range(len(starts))], dim=2)
        ctx.calls, ctx.states, ctx.c, ctx.scale = calls, states, c, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        c = ctx.c
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        grad = grad.contiguous()
        for (i, k0, k1, causal), state in zip(ctx.calls, ctx.states):
            rows = slice(i * c, (i + 1) * c)
            gq, gk, gv = sdpa_backward_with_lse(
                grad[:, :, rows],
                q[:, :, rows],
                k[:, :, k0:k1],
                v[:, :, k0:k1],
                out[:, :, rows],
                lse[:, :, rows].contiguous(),
                causal,
                ctx.scale,
                state,
            )
            dq[:, :, rows] += gq
            dk[:, :, k0:k1] += gk
            dv[:, :, k0:k1] += gv
        return dq, dk, dv, None, None


def causal_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: tuple[int, ...], scale: float | None = None
) -> torch.Tensor:
    """Causal attention [B, H, n c, D] of query chunks at global chunk indices `starts` (c tokens each) against
    the whole sequence's keys and values [B, Hkv, S, D] in global order; dropout off."""
    return _CausalBlocks.apply(q, k, v, tuple(starts), scale)
