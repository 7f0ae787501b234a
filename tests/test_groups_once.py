"""A second build on the same ranks and shape makes no process group (pp_tp/base/per_world.py): it gets the first
build's mesh and tied-weight groups, and both builds pass the float64 verdict against the plain model. A build after
one on another mesh whose "tp" submesh is equal to its own (the same ranks) puts every parameter on its own mesh's
groups, not on the earlier mesh's (pp_tp/parallel/mesh.py `build_on`)."""

from __future__ import annotations

from dataclasses import replace

import parity_utils as pu
import torch.distributed as dist
from harness import os_threads  # every gloo group keeps its own threads: they count the groups made

import pp_tp
from pp_tp.parity import dp_share

TIED = replace(pu.TINY, tie_embeddings=True)
CASES = {  # the tied copies on both pp ranks (a group per tp rank), and on pp ranks 0 and 3 of 4 (a subset of pp)
    "pp2_tp2": dict(pp=2, tp=2, schedule="1F1B", microbatches=2, embedding="vocab_parallel"),
    "pp4": dict(pp=4, schedule="1F1B", microbatches=4),
}


def twice_case() -> dict:
    out = {}
    for name, kw in CASES.items():
        pcfg = pu.pcfg_of(**kw)
        first = pu.compare(pcfg, TIED)
        before = os_threads()
        second = pu.compare(pcfg, TIED, steps=2)
        out[name] = dict(
            first=first,
            second=second,
            same_mesh=pp_tp.build_mesh(pcfg) is pp_tp.build_mesh(pcfg),
            made_by_second=os_threads() - before,
        )
    before = os_threads()
    dist.new_group(list(range(dist.get_world_size())))  # what making a group shows in the count
    out["made_by_new_group"] = os_threads() - before
    return out


def test_a_second_build_reuses_the_first_builds_groups(world):
    results = world(4).run(twice_case)
    for name in CASES:
        for r in results:
            c = r[name]
            pu.assert_passes(c["first"], name)  # (a tied weight sits on two pp ranks: no exactly-once cover check)
            pu.assert_passes(c["second"], name)
            assert c["same_mesh"] and c["made_by_second"] == 0, (name, c["made_by_second"])
            assert c["first"]["losses"][0] == c["second"]["losses"][0], name  # the same first step, bit for bit
    assert all(r["made_by_new_group"] > 0 for r in results)  # the count sees a group being made


def equal_submeshes_case() -> list[dict]:
    """CREDIT at pp1 x dp2 x tp2, at pp2 x tp2 (the 1x1-conv pair of `credit_ri`) and at pp1 x dp2 x tp2 again, each
    built and stepped: per build, the group names of every DTensor parameter's mesh dims and those of its own mesh."""
    import test_nonlm as nl  # the CREDIT models and their declared TP

    out = []
    for kind, kw in (
        ("credit", dict(tp=2, dp_shard=2)),
        ("credit_ri", dict(pp=2, tp=2)),
        ("credit", dict(tp=2, dp_shard=2)),
    ):
        pcfg = pu.pcfg_of(**kw, microbatches=2)
        mesh = pp_tp.build_mesh(pcfg)
        pipe = pp_tp.build_pipeline(nl._model(kind, "meta"), mesh, pcfg, state_dict=nl._state(kind), loss_fn="mse")
        x, y = nl._batch(kind)
        pipe.step(dp_share(mesh, x), dp_share(mesh, y))
        held = {
            p.device_mesh.get_group(i).group_name
            for part in pipe.model_parts
            for p in part.parameters()
            if hasattr(p, "device_mesh")
            for i in range(p.device_mesh.ndim)
        }
        out.append({"kind": kind, "held": held, "own": {mesh.get_group(d).group_name for d in mesh.mesh_dim_names}})
    return out


def test_a_build_after_one_on_an_equal_submesh_holds_its_own_groups(world):
    for r in world(4).run(equal_submeshes_case):
        for build in r:
            assert build["held"] and build["held"] <= build["own"], build
