"""The stage builder: plans, the stage module's names, per-rank materialization, and pp-only parity."""

from __future__ import annotations

import itertools
from dataclasses import replace

import parity_utils as pu
import pytest
import torch

import pp_tp
from pp_tp.config import ParallelConfig, resolve_parallel
from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.models.reference import REFERENCE
from pp_tp.models.reference.model import ModelArgs, Transformer
from pp_tp.split import cost
from pp_tp.split.plan import _minmax_partition, plan_stages
from pp_tp.stages.stage_module import StageModule


def _meta(args: ModelArgs = pu.TINY, hf: bool = False):
    return pu.make_model(args, hf, device="meta")


def _plan(args=pu.TINY, hf=False, **kw):
    model = _meta(args, hf)
    kw.setdefault("pp", 2)
    kw.setdefault("microbatches", 16)
    pcfg = resolve_parallel(ParallelConfig(**kw), world_size=kw["pp"])  # as build_pipeline does first
    return model, plan_stages(model, layout_for(model), pcfg)


# --- plans ---------------------------------------------------------------------------------------


def test_even_split_uneven_layers_never_drops_or_duplicates():
    _, plan = _plan(replace(pu.TINY, n_layers=7), pp=3)
    assert [s.blocks for s in plan.stages] == [["0", "1", "2"], ["3", "4"], ["5", "6"]]
    assert plan.stages[0].embed and plan.stages[-1].head and not plan.stages[1].embed


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(ConfigError, match="model.n_layers = 4 is fewer than the 5 pipeline stages"):
        _plan(pp=5, schedule="GPipe")


def test_weighted_split_moves_layers_away_from_heavy_ends():
    _, plan = _plan(replace(pu.TINY, n_layers=10), pp=2, split="weighted", split_embed_weight=0, split_head_weight=4)
    assert [len(s.blocks) for s in plan.stages] == [7, 3]
    _, plan = _plan(replace(pu.TINY, n_layers=10), pp=2, split="weighted", split_embed_weight=2, split_head_weight=2)
    assert [len(s.blocks) for s in plan.stages] == [5, 5]


def test_layers_per_stage_and_its_errors():
    _, plan = _plan(pp=2, split="layers_per_stage", layers_per_stage=[1, 3])
    assert [s.blocks for s in plan.stages] == [["0"], ["1", "2", "3"]]
    with pytest.raises(ConfigError, match="layers_per_stage"):
        _plan(pp=2, split="layers_per_stage", layers_per_stage=[1, 2])


def test_explicit_fqn_lists_and_their_errors():
    fqns = [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "norm", "output"]]
    _, plan = _plan(pp=2, split="explicit", stage_fqns=fqns)
    assert [s.blocks for s in plan.stages] == [["0"], ["1", "2", "3"]]
    bad = {
        "is empty": [[], fqns[0] + fqns[1]],
        "unknown module 'layers.9'": [fqns[0] + ["layers.9"], fqns[1]],
        "misses 'layers.0'": [["tok_embeddings"], fqns[1]],
        "breaks model order": [["tok_embeddings", "layers.1"], ["layers.0"] + fqns[1][1:]],
    }
    for message, lists in bad.items():
        with pytest.raises(ConfigError, match=message):
            _plan(pp=2, split="explicit", stage_fqns=lists)


def test_minmax_partition_is_optimal_by_brute_force():
    weights = [0.5, 3, 1, 4, 1, 5, 9, 2, 6, 2.5]
    for k in (2, 3, 4):
        sizes = _minmax_partition(weights, k)
        assert sum(sizes) == len(weights) and min(sizes) >= 1

        def worst(sz):
            bounds = list(itertools.accumulate([0] + list(sz)))
            return max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))

        best = min(
            worst(c)
            for cuts in itertools.combinations(range(1, len(weights)), k - 1)
            for c in [[b - a for a, b in zip((0,) + cuts, cuts + (len(weights),))]]
        )
        assert worst(sizes) == pytest.approx(best)


def test_balanced_split_accounts_for_a_big_vocabulary_head():
    args = replace(pu.TINY, vocab_size=1024, n_layers=8)
    model, plan = _plan(args, pp=2, split="balanced")
    counts = [len(s.blocks) for s in plan.stages]
    assert counts[0] > counts[1], counts  # the head costs several blocks, so the last stage gets fewer
    d = REFERENCE.dims(model)
    costs = [s.cost for s in plan.stages]
    expect_last = counts[1] * cost.block_flops(d, d.max_seq_len) + cost.head_flops(d)
    assert costs[1] == pytest.approx(expect_last)
    # moving one layer either way would not lower the most expensive stage
    for c0 in {max(counts[0] - 1, 0), min(counts[0] + 1, 8)} - {counts[0]}:
        alt = max(
            cost.embed_flops(d) + c0 * cost.block_flops(d, d.max_seq_len),
            (8 - c0) * cost.block_flops(d, d.max_seq_len) + cost.head_flops(d),
        )
        assert max(costs) <= alt


def test_stage_to_rank_mappings():
    _, loop = _plan(pp=2, stages_per_rank=2, schedule="Interleaved1F1B", microbatches=4)
    assert [s.rank for s in loop.stages] == [0, 1, 0, 1]
    _, v = _plan(pp=2, stages_per_rank=2, schedule="ZBVZeroBubble", microbatches=4)
    assert [s.rank for s in v.stages] == [0, 1, 1, 0]
    assert [s.index for s in v.for_rank(0)] == [0, 3]


def test_plan_table_lists_every_stage():
    model, plan = _plan(pp=2)
    lines = plan.table().splitlines()
    assert len(lines) == 3 and "params" in lines[0] and "embed" in lines[1] and "head" in lines[2]
    assert sum(s.params for s in plan.stages) == sum(p.numel() for p in model.parameters())


# --- the stage module ----------------------------------------------------------------------------


@pytest.mark.parametrize("hf", [False, True])
def test_stage_state_dict_keys_partition_the_full_model(hf):
    model, plan = _plan(hf=hf, pp=4)
    layout = layout_for(model)
    assert layout.name == ("hf" if hf else "reference") and (hf or layout is REFERENCE)
    keys = [k for s in plan.stages for k in StageModule(model, layout, s).state_dict()]
    assert sorted(keys) == sorted(model.state_dict()) and len(keys) == len(set(keys))


def test_chained_stages_equal_the_full_model_in_one_process():
    model = Transformer(pu.TINY)
    model.init_weights(0)
    _, plan = _plan(pp=4, schedule="GPipe")
    stages = [StageModule(model, REFERENCE, s) for s in plan.stages]
    ids = torch.randint(0, pu.TINY.vocab_size, (2, 8))
    h = ids
    for s in stages:
        h = s(h)
    torch.testing.assert_close(h, model(ids))


# --- multi-rank: parity and memory ---------------------------------------------------------------

SPLITS = [
    dict(split="even"),
    dict(split="weighted", split_embed_weight=0.5, split_head_weight=1.5),
    dict(split="balanced"),
]


def _parity_cases(pp: int) -> list[dict]:
    n = pu.TINY.n_layers
    lps = [1] * (pp - 1) + [n - pp + 1]
    fqns = [["tok_embeddings", "layers.0"]] + [[f"layers.{i}"] for i in range(1, pp - 1)]
    fqns += [[f"layers.{i}" for i in range(pp - 1, n)] + ["norm", "output"]]
    return SPLITS + [dict(split="layers_per_stage", layers_per_stage=lps), dict(split="explicit", stage_fqns=fqns)]


def split_parity_case(pp: int) -> list[dict]:
    out = []
    for kw in _parity_cases(pp):
        res = pu.compare(pu.pcfg_of(pp=pp, schedule="1F1B", microbatches=pp, **kw))
        res["split"] = kw["split"]
        out.append(res)
    return out


@pytest.mark.parametrize("pp", [2, 4])
def test_every_split_mode_matches_the_full_model(world, pp):
    per_rank = world(pp).run(split_parity_case, pp)
    for i in range(len(per_rank[0])):
        pu.assert_parity([r[i] for r in per_rank])


def hf_parity_case() -> dict:
    return pu.compare(pu.pcfg_of(pp=2, schedule="1F1B", microbatches=2), hf=True, steps=2)


def test_hf_llama_for_causal_lm_matches(world):
    pu.assert_parity(world(2).run(hf_parity_case))


def memory_and_init_case() -> dict:
    """Each rank allocates only its stages; seeded init equals the single-process init_weights."""
    pcfg = pu.pcfg_of(pp=2, schedule="1F1B", microbatches=2, split="layers_per_stage", layers_per_stage=[1, 3])
    pipe = pu.pp_tp.build_pipeline(_meta(), pp_tp.build_mesh(pcfg), pcfg, seed=7)
    ref = Transformer(pu.TINY)
    ref.init_weights(7)
    full = dict(ref.named_parameters())
    mismatched = [k for part in pipe.model_parts for k, p in part.named_parameters() if not torch.equal(p, full[k])]
    allocated = sum(p.numel() * p.element_size() for part in pipe.model_parts for p in part.parameters())
    planned = sum(s.params for s in pipe.plan.stages if s.rank == pipe.mesh.get_local_rank("pp")) * 4
    return {"allocated": allocated, "planned": planned, "mismatched": mismatched}


def test_each_rank_materializes_only_its_share(world):
    res = world(2).run(memory_and_init_case)
    for r in res:
        assert r["allocated"] == r["planned"] and not r["mismatched"], r
    assert res[0]["allocated"] < res[1]["allocated"]  # 1 layer + embedding vs 3 layers + head
