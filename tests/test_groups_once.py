"""A second build on the same ranks and shape makes no process group (pp_tp/base/per_world.py): it gets the first
build's mesh and tied-weight groups, and computes what the first computed."""

from __future__ import annotations

import os
from dataclasses import replace

import parity_utils as pu
import torch
import torch.distributed as dist

TIED = replace(pu.TINY, tie_embeddings=True)
TIED_PP2_TP2 = dict(pp=2, tp=2, schedule="1F1B", microbatches=2, embedding="vocab_parallel")


def _threads() -> int:
    """Every gloo group keeps its own threads: a rank's OS threads count the groups it made."""
    return len(os.listdir("/proc/self/task"))


def twice_case() -> dict:
    pcfg = pu.pcfg_of(**TIED_PP2_TP2)
    state = pu.reference_state(TIED)
    ids, labels = pu.batch(TIED, 8, 16)
    first = pu.run_pipeline(pcfg, state, ids, labels, TIED)
    after_first = _threads()
    second = pu.run_pipeline(pcfg, state, ids, labels, TIED)
    after_second = _threads()
    dist.new_group(list(range(dist.get_world_size())))  # what making a group shows in the count
    grads_equal = all(torch.equal(first["grads"][k], second["grads"][k]) for k in first["grads"])
    return dict(
        same_mesh=first["pipe"].mesh is second["pipe"].mesh,
        made_by_second=after_second - after_first,
        made_by_new_group=_threads() - after_second,
        losses=(first["losses"], second["losses"]),
        grads_equal=grads_equal and bool(first["grads"]),
    )


def test_a_second_build_reuses_the_first_builds_groups(world):
    for r in world(4).run(twice_case):
        assert r["same_mesh"] and r["made_by_second"] == 0, r
        assert r["made_by_new_group"] > 0, r  # the count sees a group being made
        assert r["losses"][0] == r["losses"][1] and r["grads_equal"], r
