"""Expert-parallel all-to-all bytes against the analytic minimum, on 4 gloo ranks.

    python bench/moe_alltoall.py

The reference MoE (8 experts, top 2, dim 64) at pp1 x dp_shard4 x ep4 (and ep2), one training step of 2 microbatches.
For every MoE layer and microbatch it records, on each rank, the rows the two forward all-to-alls (tokens out to
their experts, outputs back) send to other ranks (from the split sizes the dispatch passes to torch), and
independently the analytic minimum: the routing slots whose expert lives on another rank (from the router's
top_k_index), each of which must leave once and come back once. A capacity-factor dispatch (Switch/GShard style,
factor 1.25) would send capacity * (ep - 1) / ep rows each way whatever the routing, shown beside. Bytes = rows *
dim * 4 (fp32); backward moves the same rows again.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from types import ModuleType

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from harness import World  # noqa: E402
from torch import nn  # noqa: E402

import pp_tp

DIM, EXPERTS, TOP_K, BATCH, SEQ, MICROBATCHES = 64, 8, 2, 8, 64, 2


@contextlib.contextmanager
def routed_rows(dispatch: ModuleType, models: Iterable[nn.Module], ep: int, rank: int, experts: int, dim: int
                ) -> Iterator[dict[str, int]]:  # fmt: skip
    """While open, counts on this rank the rows the forward token all-to-alls send off-rank ("sent": `dispatch`'s
    `all_to_all_single_autograd` is wrapped, the name an EP dispatch calls, pp_tp's or transformers') and the
    analytic minimum ("minimum": routing slots whose expert lives on another rank, from the `top_k_index` every
    module named "...experts" receives)."""
    counts = {"sent": 0, "minimum": 0, "calls": 0}
    local, original = experts // ep, dispatch.all_to_all_single_autograd

    def counting(x, recv, send, group):
        if x.requires_grad and len(send) == ep and x.shape[0] == sum(send) and x.shape[-1] == dim:
            counts["sent"] += sum(send) - send[rank]  # rows that leave this rank
            counts["calls"] += 1
        return original(x, recv, send, group)

    def analytic(module, inputs):
        counts["minimum"] += int((inputs[1].reshape(-1) // local != rank).sum())

    hooks = [m.register_forward_pre_hook(analytic) for model in models for name, m in model.named_modules()
             if name.endswith("experts")]  # fmt: skip
    dispatch.all_to_all_single_autograd = counting
    try:
        yield counts
    finally:
        dispatch.all_to_all_single_autograd = original
        for h in hooks:
            h.remove()


def case(ep: int) -> dict:

    import parity_utils as pu

    from pp_tp.models.reference.model import ModelArgs
    from pp_tp.parallel import expert_dispatch

    args = ModelArgs(vocab_size=256, dim=DIM, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=SEQ,
                     n_experts=EXPERTS, top_k=TOP_K, moe_ffn_dim=64)  # fmt: skip
    pcfg = pu.pcfg_of(pp=1, dp_shard=4, ep=ep, microbatches=MICROBATCHES)
    mesh = pp_tp.build_mesh(pcfg)
    pipe = pp_tp.build_pipeline(pu.make_model(args, device="meta"), mesh, pcfg, seed=0)
    ids, labels = pu.batch(args, BATCH, SEQ)
    share = slice(pp_tp.parallel.mesh.dp_rank(mesh) * 2, pp_tp.parallel.mesh.dp_rank(mesh) * 2 + 2)
    with routed_rows(expert_dispatch, pipe.model_parts, ep, mesh["ep"].get_local_rank(), EXPERTS, DIM) as counts:
        pipe.step(ids[share], labels[share])
    tokens = 2 * SEQ * args.n_layers  # this rank's tokens over the step, per MoE layer summed
    return {**counts, "slots": tokens * TOP_K}


def main() -> None:
    world = World(4)
    try:
        for ep in (2, 4):
            rows = world.run(case, ep)
            sent, minimum = sum(r["sent"] for r in rows), sum(r["minimum"] for r in rows)
            slots = sum(r["slots"] for r in rows)
            capacity = 2 * int(1.25 * slots * (ep - 1) / ep)
            print(
                f"ep={ep}: rows sent off-rank by the forward all-to-alls (out and back, all ranks, one step) = {sent}; "
                f"analytic minimum 2 x {minimum} = {2 * minimum} (ratio {sent / max(2 * minimum, 1):.3f}); capacity "
                f"factor 1.25 would send {capacity}; bytes = rows * {DIM} * 4 = {sent * DIM * 4:,}"
            )
    finally:
        world.close()


if __name__ == "__main__":
    main()
