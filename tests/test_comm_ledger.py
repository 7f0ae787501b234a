"""The communication ledger: what it sees (backward, DTensor, p2p), and FSDP's collectives per step through it:
one all-gather and one reduce-scatter per unit per step, the controls that repeat them, FSDP x TP and HSDP, and
reduce-scatters every k microbatches as the planner's step walk predicts.
"""

from __future__ import annotations

from dataclasses import replace

import parity_utils as pu
import pytest
import torch
import torch.distributed as dist
from one_trip import run_cases

import pp_tp
from pp_tp.diagnostics.comm_ledger import CommLedger

ARGS8 = replace(pu.TINY, n_layers=8)


def ledger_basics_case() -> dict:
    """The ledger sees collectives issued from autograd backward, DTensor's functional collectives, and p2p."""
    from torch.distributed.tensor import Shard, distribute_tensor

    rank, world = dist.get_rank(), dist.get_world_size()

    class AllReduceInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            g = g.clone()
            dist.all_reduce(g)
            return g

    mesh = pu.flat_mesh(world)
    with CommLedger() as led:
        x = torch.ones(8, requires_grad=True)
        AllReduceInBackward.apply(x).sum().backward()
        led.next_step()
        distribute_tensor(torch.arange(4.0 * world), mesh, [Shard(0)], src_data_rank=None).full_tensor()
        led.next_step()
        send, recv = torch.full((3,), float(rank)), torch.empty(3)
        reqs = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        )
        for req in reqs:
            req.wait()
    return {
        "steps": [led.counts(s) for s in range(3)],
        "bytes": [led.bytes(s) for s in range(3)],
        "sizes": sorted({e.group_size for e in led.events}),
        "dtensor_group_ok": [e.group for e in led.events if e.step == 1] == [mesh.get_group().group_name],
        "recv": recv.tolist(),
    }


@pytest.fixture(scope="module")
def four_ranks(world) -> dict[str, list]:
    """Every 4-rank case of this file in one round trip (tests/one_trip.py)."""
    cases = [ledger_basics_case, ledger_matrix_case, ledger_controls_case, grad_reduce_ledger_case]
    return run_cases(world(4), [(fn.__name__, fn, ()) for fn in cases])


def test_ledger_sees_backward_dtensor_and_p2p(four_ranks):
    for rank, r in enumerate(four_ranks["ledger_basics_case"]):
        assert r["steps"] == [{"all_reduce": 1}, {"all_gather": 1}, {"send": 1, "recv": 1}], r
        assert r["bytes"] == [{"all_reduce": 32}, {"all_gather": 64}, {"send": 12, "recv": 12}], r
        assert r["sizes"] == [4] and r["dtensor_group_ok"]
        assert r["recv"] == [float((rank - 1) % 4)] * 3


def ledger_case(kw: dict, args=pu.TINY, steps: int = 2, gather_fix: bool = True) -> dict:
    """FSDP traffic (dp_shard group) per step for `steps` steps, the FSDP unit count and the local param bytes.

    `gather_fix=False` runs torch's own UNSHARD/RESHARD placement (the control for pytorch#164756).
    """
    from pp_tp.runtime import pipeline

    pcfg = pu.pcfg_of(**kw)
    mesh = pp_tp.build_mesh(pcfg)
    fix = pipeline._gather_params_once
    pipeline._gather_params_once = fix if gather_fix else (lambda schedule: None)
    try:
        pipe = pu.pp_tp.build_pipeline(
            pu.make_model(args, device="meta"), mesh, pcfg, state_dict=pu.reference_state(args)
        )
        ids, labels = pu.batch(args, 2 * pcfg.microbatches, 12)  # this DP rank's batch: microbatches of 2
        with CommLedger() as led:
            for _ in range(steps):
                led.next_step()
                for part in pipe.model_parts:
                    part.zero_grad()
                pipe.step(ids, labels)
    finally:
        pipeline._gather_params_once = fix
    dp = mesh.get_group("dp_shard")
    replicate = mesh.get_group("dp_replicate").group_name
    fsdp_kinds = ("all_gather", "reduce_scatter")  # the dp group also carries the loss's scalar all-reduces
    return {
        "stage_units": {p.spec.index: len(p.block_modules()) + (p.is_first or p.is_last) for p in pipe.model_parts},
        "fsdp": [{k: v for k, v in led.counts(s, group=dp).items() if k in fsdp_kinds} for s in range(steps)],
        "fsdp_bytes": [led.bytes(s, group=dp) for s in range(steps)],
        "pp": led.counts(-1, group=mesh.get_group("pp")),
        # HSDP's gradient all-reduces (the loss's scalar all-reduces are 8 bytes)
        "replicate_grad_all_reduces": sum(
            e.group == replicate and e.kind == "all_reduce" and e.nbytes > 8 for e in led.events if e.step == steps - 1
        ),
        "units": sum(len(p.block_modules()) + (p.is_first or p.is_last) for p in pipe.model_parts),
        "param_bytes": sum(p.numel() * 4 for part in pipe.model_parts for p in part.parameters()),
    }


LEDGER = [  # (schedule, stages_per_rank, args, microbatches): every multi-stage schedule, 4 stages per rank
    ("1F1B", 1, pu.TINY, (4, 8)),
    ("Interleaved1F1B", 2, pu.TINY, (4, 8)),
    ("ZBVZeroBubble", 2, pu.TINY, (4, 8)),
    ("Interleaved1F1B", 4, ARGS8, (4, 8)),
    ("LoopedBFS", 2, pu.TINY, (4,)),
    ("InterleavedZeroBubble", 2, pu.TINY, (4,)),
    ("DualPipeV", 2, pu.TINY, (4,)),
]


def ledger_matrix_case() -> list[tuple[str, int, dict]]:
    return [
        (
            f"{s} stages_per_rank={spr} microbatches={m}",
            m,
            ledger_case(dict(pp=2, dp_shard=2, schedule=s, stages_per_rank=spr, microbatches=m), args),
        )
        for s, spr, args, ms in LEDGER
        for m in ms
    ]


def test_ledger_one_all_gather_and_reduce_scatter_per_unit_per_step(four_ranks):
    for per_rank in four_ranks["ledger_matrix_case"]:
        for where, m, r in per_rank:
            for counts, nbytes in zip(r["fsdp"][1:], r["fsdp_bytes"][1:]):
                assert counts == {"all_gather": r["units"], "reduce_scatter": r["units"]}, (where, counts)
                # The whole local model, gathered once (FSDP pads each parameter by a few bytes at most).
                assert nbytes["all_gather"] == nbytes["reduce_scatter"], where
                assert r["param_bytes"] <= nbytes["all_gather"] < 1.01 * r["param_bytes"], (where, nbytes)
            if where.startswith("1F1B"):  # one activation out and one gradient back per microbatch
                assert r["pp"]["send"] == r["pp"]["recv"] == m, r["pp"]


def ledger_controls_case() -> dict:
    """Without the schedule rewrite, or with `always`, all-gathers repeat within a step: the ledger sees it.
    With bf16 the all-gather moves bf16 parameters and the reduce-scatter fp32 gradients."""
    four = dict(pp=2, dp_shard=2, schedule="Interleaved1F1B", stages_per_rank=4, microbatches=8)
    always = dict(pp=2, dp_shard=2, schedule="1F1B", fsdp_reshard_after_forward="always")
    return {
        "torch_placement": ledger_case(four, ARGS8, gather_fix=False),
        "always4": ledger_case(dict(always, microbatches=4)),
        "always8": ledger_case(dict(always, microbatches=8)),
        "bf16": ledger_case(dict(pp=2, dp_shard=2, schedule="1F1B", microbatches=4, mixed_precision="bf16")),
    }


def test_ledger_controls_detect_repeated_all_gathers(four_ranks):
    for r in four_ranks["ledger_controls_case"]:
        torch_placement = r["torch_placement"]
        assert torch_placement["fsdp"][1]["all_gather"] > torch_placement["units"]
        assert torch_placement["fsdp"][1]["reduce_scatter"] == torch_placement["units"]
        a4, a8 = r["always4"]["fsdp"][1], r["always8"]["fsdp"][1]
        assert r["always4"]["units"] < a4["all_gather"] < a8["all_gather"]
        assert a4["reduce_scatter"] == a8["reduce_scatter"] == r["always4"]["units"]
        bf16 = r["bf16"]
        assert bf16["fsdp"][1] == {"all_gather": bf16["units"], "reduce_scatter": bf16["units"]}
        nbytes = bf16["fsdp_bytes"][1]
        assert bf16["param_bytes"] <= nbytes["reduce_scatter"] < 1.01 * bf16["param_bytes"], nbytes
        assert nbytes["all_gather"] == pytest.approx(nbytes["reduce_scatter"] / 2, rel=0.01), nbytes


def hsdp_tp_ledger_case() -> dict:
    """World 8: FSDP x TP keeps one all-gather per unit per step; HSDP adds one all-reduce per unit on dp_replicate."""
    tp = ledger_case(dict(pp=2, tp=2, dp_shard=2, schedule="1F1B", microbatches=4))
    hsdp_cfg = dict(pp=2, dp_replicate=2, dp_shard=2, schedule="ZBVZeroBubble", stages_per_rank=2, microbatches=4)
    return {"tp": tp, "hsdp": ledger_case(hsdp_cfg)}


def test_ledger_fsdp_x_tp_and_hsdp(world):
    for r in world(8).run(hsdp_tp_ledger_case):
        for key in ("tp", "hsdp"):
            units = r[key]["units"]
            assert r[key]["fsdp"][1] == {"all_gather": units, "reduce_scatter": units}, (key, r[key])
        assert r["hsdp"]["replicate_grad_all_reduces"] == r["hsdp"]["units"], r["hsdp"]
        assert r["tp"]["replicate_grad_all_reduces"] == 0


# --- gradient reduction every k microbatches (parallel.fsdp_grad_reduce) --------------------------


# (schedule, stages per rank, [(fsdp_reshard_after_forward, fsdp_grad_reduce)]): every policy pair on 1F1B, and
# each other schedule with pairs that together cover both reshard values and all three reduce values
# (ZBVZeroBubble refuses "always": torch leaves its weight gradients unset).
_BOTH = ("default", "always")
GRAD_REDUCE = [
    ("1F1B", 1, [(r, k) for r in _BOTH for k in ("step", "microbatch", 3)]),
    ("GPipe", 1, [("always", 3), ("default", "microbatch")]),
    ("Interleaved1F1B", 2, [("always", "microbatch"), ("default", 3)]),
    ("ZBVZeroBubble", 2, [("default", "step"), ("default", 3)]),
]


def grad_reduce_ledger_case() -> list[tuple[dict, dict]]:
    out = []
    for schedule, spr, policies in GRAD_REDUCE:
        for reshard, reduce in policies:
            kw = dict(pp=2, dp_shard=2, schedule=schedule, stages_per_rank=spr, microbatches=4)
            kw.update(fsdp_reshard_after_forward=reshard, fsdp_grad_reduce=reduce)
            out.append((kw, ledger_case(kw)))
    return out


def test_ledger_grad_reduce_counts_per_unit(four_ranks):
    """Reduce-scatters per unit = ceil(m / k); all-gathers as the planner's step walk predicts for the policy."""
    from pp_tp.config.fsdp_policy import FsdpPolicy
    from pp_tp.planner.schedule_sim import schedule_actions
    from pp_tp.planner.walk import StageBytes, walk_step

    for pp_rank, per_rank in enumerate(four_ranks["grad_reduce_ledger_case"][::2]):  # dp_shard rank 0 of each pp
        for kw, r in per_rank:
            policy = FsdpPolicy.for_rank(pu.pcfg_of(**kw), pp_rank)
            actions = schedule_actions(kw["schedule"], 2, 4, kw["stages_per_rank"])[pp_rank]
            units = r["stage_units"]
            walk = walk_step(actions, {s: StageBytes(1) for s in units}, policy, 4)
            k = {"step": 4, "microbatch": 1}.get(kw["fsdp_grad_reduce"], kw["fsdp_grad_reduce"])
            assert all(n == -(-4 // k) for n in walk.reduce_scatters.values()), (kw, walk)
            expected = {
                "all_gather": sum(walk.all_gathers[s] * n for s, n in units.items()),
                "reduce_scatter": sum(walk.reduce_scatters[s] * n for s, n in units.items()),
            }
            assert r["fsdp"][1] == expected, (kw, r["fsdp"][1], expected)
            gathers_per_unit = {("default", "step"): 1, ("always", "step"): 5, ("always", "microbatch"): 8}
            key = (kw["fsdp_reshard_after_forward"], kw["fsdp_grad_reduce"])
            if key in gathers_per_unit:  # m = 4: each forward, then backwards that find the unit sharded
                assert set(walk.all_gathers.values()) == {gathers_per_unit[key]}, (kw, walk)
