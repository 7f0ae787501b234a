"""The non-finite guard: a NaN injected into one stage stops every rank with the same line naming the step
and the stage and its ranks, or, with training.skip_nonfinite, skips that step (counted) and trains on."""

from __future__ import annotations

import math

import pytest
import torch
from train_utils import job

import pp_tp
from pp_tp.config import config_from_dict
from pp_tp.train.nonfinite import NonFiniteError


def nan_case(d: dict, restore: bool) -> list:
    """Sets a stage-1 weight to NaN before step 2 (and back before step 3 when `restore`)."""
    from pp_tp.train.trainer import Trainer

    cfg = config_from_dict(d)
    trainer, saved = Trainer(cfg, mesh=pp_tp.build_mesh(cfg.parallel)), {}

    def before_step(step: int) -> None:
        for part in trainer.pipe.model_parts:
            if part.spec.index == 1:
                w = next(part.parameters())
                local = w.to_local() if hasattr(w, "to_local") else w
                with torch.no_grad():
                    if step == 2:
                        saved["w"] = local.clone()
                        local.fill_(float("nan"))
                    elif step == 3 and restore:
                        local.copy_(saved["w"])

    try:
        return [{k: r[k] for k in ("step", "loss", "skipped_steps")} for r in trainer.run(before_step)]
    except NonFiniteError as e:
        return [str(e)]


def both_cases() -> dict[str, list]:
    """The stopping and the skipping job in one round trip, on the session's meshes (pp_tp.build_mesh)."""
    return {
        "stop": nan_case(job(training={"steps": 3}), False),
        "skip": nan_case(job(training={"steps": 3, "skip_nonfinite": True}), True),
    }


@pytest.fixture(scope="module")
def four_ranks(world) -> list[dict]:
    return world(4).run(both_cases)


def test_a_nan_on_one_stage_stops_every_rank_with_the_same_line(four_ranks):
    res = [r["stop"] for r in four_ranks]
    assert all(r == res[0] for r in res) and len(res[0]) == 1, res
    line = res[0][0]
    assert line.startswith("step 2: non-finite loss nan") and "first at stage 1 output (ranks 2, 3)" in line, line
    assert "skip_nonfinite" in line and "\n" not in line


def test_skip_nonfinite_skips_the_step_and_trains_on(four_ranks):
    res = [r["skip"] for r in four_ranks]
    for rows in res:
        assert [r["skipped_steps"] for r in rows] == [0, 1, 1], rows
        assert math.isnan(rows[1]["loss"]) and all(math.isfinite(r["loss"]) for r in rows[2:]), rows
        assert str(rows) == str(res[0])  # nan != nan
