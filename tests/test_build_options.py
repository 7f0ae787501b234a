"""build_pipeline's options as one frozen value: its keywords and `options=` make the same pipeline."""

from __future__ import annotations

import dataclasses

import parity_utils as pu
import pytest
import torch

import pp_tp
from pp_tp import BuildOptions, MoEConfig

KEYWORDS = dict(seed=7, rng_seed=5, seq_len=16, source_dir="SRC", moe=MoEConfig())


def test_build_options_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        BuildOptions().seed = 1  # type: ignore[misc]


def test_keywords_replace_fields_and_defaults_follow_other_fields():
    base = BuildOptions(seed=3, checkpoint="HF")
    assert BuildOptions.of(base, {"seq_len": 8}) == BuildOptions(seed=3, checkpoint="HF", seq_len=8)
    assert BuildOptions.of(None, {}) == BuildOptions()
    assert (base.hf_source_dir, base.dropout_seed, base.balancing) == ("HF", 3, MoEConfig())
    assert BuildOptions(seed=3, rng_seed=4, source_dir="SRC", checkpoint="HF").dropout_seed == 4
    assert BuildOptions(source_dir="SRC", checkpoint="HF").hf_source_dir == "SRC"


def test_unknown_keyword_fails_before_anything_is_built():
    with pytest.raises(TypeError, match="sed"):
        pp_tp.build_pipeline(pu.make_model(device="meta"), None, pu.pcfg_of(pp=2), sed=1)


def keywords_and_options_case() -> dict:
    """The same pipeline from build_pipeline's keywords and from options=: same options, values, streams and loss."""
    pcfg = pu.pcfg_of(pp=2, schedule="1F1B", microbatches=2)
    mesh = pp_tp.build_mesh(pcfg)
    by_kw = pp_tp.build_pipeline(pu.make_model(device="meta"), mesh, pcfg, **KEYWORDS)
    by_opts = pp_tp.build_pipeline(pu.make_model(device="meta"), mesh, pcfg, options=BuildOptions(**KEYWORDS))
    ids, labels = pu.batch(pu.TINY, 4, 16)
    pairs = [
        (p, q)
        for a, b in zip(by_kw.model_parts, by_opts.model_parts)
        for p, q in zip(a.state_dict().values(), b.state_dict().values())
    ]
    return {
        "same_options": by_kw.options == by_opts.options == BuildOptions(**KEYWORDS),
        "source_dir": (by_kw.source_dir, by_opts.source_dir),
        "stages": (by_kw.stage_indices, by_opts.stage_indices),
        "same_values": all(torch.equal(p, q) for p, q in pairs) and bool(pairs),
        "losses": (float(by_kw.step(ids, labels)), float(by_opts.step(ids, labels))),
    }


def test_keywords_and_options_build_the_same_pipeline(world):
    for r in world(2).run(keywords_and_options_case):
        assert r["same_options"] and r["same_values"], r
        assert r["source_dir"] == ("SRC", "SRC") and r["stages"][0] == r["stages"][1], r
        assert r["losses"][0] == r["losses"][1], r
