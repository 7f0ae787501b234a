"""Schedules: the registry's constraints, the Pipeline runner's contract, and the parity matrix.

The matrix runs the schedules on the layouts against the single-process build, with uneven padding: loss, every full
gradient and parameters after 2 AdamW steps, judged by the float64 verdict (pp_tp/parity). Every schedule runs at one
pp4 layout and at one small pp2 layout, rotating so that each of the seven layouts of at most 8 ranks (pp in {2, 4},
tp and dp in {1, 2}) meets at least two schedules, and one schedule of each kind at pp2 x tp2 x dp2 (all three dims at
once). The cases of one world size run in one round trip (tests/one_trip.py).
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import parity_utils as pu
import pytest
import torch
from one_trip import run_cases
from torch.distributed.pipelining import schedules as torch_schedules

import pp_tp
from pp_tp.errors import ConfigError
from pp_tp.schedules.registry import (
    ScheduleSpec,
    check_schedule,
    get_schedule_spec,
    register_schedule,
    schedule_names,
    stage_owner,
)

ARGS8 = replace(pu.TINY, n_layers=8)
# Eight blocks where pp x stages_per_rank > 2 (one or two per stage); four (two per stage) for one stage a rank at pp2.
ARGS4 = pu.TINY
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
MULTI = {"Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}
# (pp, tp, dp_shard): every layout of at most 8 ranks, as (the full one, the pp4 ones, the small pp2 ones)
FULL = (2, 2, 2)
PP4 = [(4, 1, 1), (4, 2, 1), (4, 1, 2)]
PP2 = [(2, 1, 1), (2, 2, 1), (2, 1, 2)]
CSV_1F1B_PP2 = "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"


# --- registry ------------------------------------------------------------------------------------


def _torch_schedule_classes() -> set[type]:
    """The concrete schedules torch.distributed.pipelining.schedules defines: public subclasses of the single- and
    multi-stage bases (the bases, and private ones like the CSV runtime and the forward-only schedule, left out)."""
    bases = (torch_schedules.PipelineScheduleSingle, torch_schedules.PipelineScheduleMulti)
    return {
        cls
        for name, cls in vars(torch_schedules).items()
        if inspect.isclass(cls)
        and cls.__module__ == torch_schedules.__name__
        and issubclass(cls, bases)
        and cls not in bases
        and not name.startswith("_")
        and not inspect.isabstract(cls)
    }


def test_every_torch_schedule_is_registered():
    """A schedule a new torch adds fails here until it is registered and in the parity matrix (SCHEDULES)."""
    torch_classes = _torch_schedule_classes()
    assert torch_classes - {get_schedule_spec(n).cls for n in schedule_names()} == set()
    assert {get_schedule_spec(n).cls for n in SCHEDULES} == torch_classes


@pytest.mark.parametrize(
    "args, message",
    [
        ((2, 1, 4, "ZBVZeroBubble"), "stages_per_rank = 1: schedule ZBVZeroBubble needs exactly 2"),
        ((2, 2, 4, "1F1B"), "stages_per_rank = 2: schedule 1F1B needs exactly 1"),
        ((4, 1, 2, "1F1B"), "microbatches = 2: schedule 1F1B needs microbatches >= number of stages (4)"),
        ((2, 2, 3, "DualPipeV"), "microbatches = 3: schedule DualPipeV needs microbatches >= number of stages (4)"),
        (
            (2, 2, 5, "Interleaved1F1B"),
            "microbatches = 5: schedule Interleaved1F1B needs microbatches to be a multiple",
        ),
        ((2, 1, 2, "1f1b"), "unknown (did you mean '1F1B'?)"),
        ((2, 1, 2, "missing.csv"), "file not found"),
    ],
)
def test_bad_combinations_are_refused_with_one_line(args, message):
    with pytest.raises(ConfigError) as e:
        check_schedule(*args)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_csv_schedule_gives_its_own_stage_mapping(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text(CSV_1F1B_PP2)
    check_schedule(2, 1, 2, str(path))
    assert stage_owner(2, 1, str(path)) == [0, 1]
    with pytest.raises(ConfigError, match="set parallel.pp = 2"):
        check_schedule(4, 1, 2, str(path))


def test_a_new_schedule_registers_without_editing_pp_tp():
    from torch.distributed.pipelining import ScheduleGPipe

    register_schedule(ScheduleSpec("MyGPipe", ScheduleGPipe, multi_stage=False, stages_per_rank=1))
    check_schedule(2, 1, 1, "MyGPipe")
    assert "MyGPipe" in schedule_names()


# --- the parity matrix ---------------------------------------------------------------------------


def _pcfg(pp: int, tp: int, dp: int, schedule: str):
    spr = 2 if schedule in MULTI else 1
    m = 2 * pp if schedule in MULTI else pp
    return pu.pcfg_of(pp=pp, tp=tp, dp_shard=dp, schedule=schedule, stages_per_rank=spr, microbatches=m)


def matrix_case(pp: int, tp: int, dp: int, schedule: str) -> dict:
    pcfg = _pcfg(pp, tp, dp, schedule)
    stages = pp * pcfg.stages_per_rank
    # Two blocks a stage at 4 ranks or fewer (every multi-stage schedule meets that at its PP2 layout); one at 8 ranks,
    # where every block costs 8 processes on this machine's cores.
    args = ARGS8 if stages > 2 and (pp * tp * dp < 8 or stages == 8) else ARGS4
    return pu.compare(pcfg, args, steps=2, batch_size=dp * pcfg.microbatches * 2, seq=12)


# The schedules run on the 8-rank FULL layout: one of each kind (single-stage, interleaved with split backward, split
# backward on a V).
ON_FULL = ("1F1B", "InterleavedZeroBubble", "DualPipeV")


def _matrix_cases() -> list[tuple[tuple[int, int, int], str]]:
    """Each schedule at one PP4 and one PP2 layout (rotating), one of each kind at FULL too: 17 cases covering every
    schedule, every dimension and every layout, where the full product (49 cases) was most of the suite's time."""
    return [
        (layout, s)
        for i, s in enumerate(SCHEDULES)
        for layout in ((FULL,) if s in ON_FULL else ()) + (PP4[i % 3], PP2[(i + 1) % 3])
    ]


def csv_case(path: str, dp: int) -> dict:
    pcfg = pu.pcfg_of(pp=2, dp_shard=dp, schedule=path, microbatches=2)
    return pu.compare(pcfg, ARGS4, steps=3, batch_size=4 * dp, seq=12)


@pytest.mark.parametrize("size", [8, 4, 2])
def test_parity_matrix_and_csv_schedule(world, tmp_path, size):
    """The matrix's cases of one world size, and the CSV-driven 1F1B at pp2 (dp 1 in the 2-rank world, dp 2 in the
    4-rank one), in one round trip."""
    cases = [
        (f"pp{pp}-tp{tp}-dp{dp}-{s}", matrix_case, (pp, tp, dp, s))
        for (pp, tp, dp), s in _matrix_cases()
        if pp * tp * dp == size
    ]
    if size < 8:
        path = tmp_path / "one_f_one_b.csv"
        path.write_text(CSV_1F1B_PP2)
        cases.append((f"csv-dp{size // 2}", csv_case, (str(path), size // 2)))
    for name, results in run_cases(world(size), cases).items():
        try:
            pu.assert_parity(results)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_matrix_covers_every_schedule_and_layout():
    """The matrix the test above runs: every schedule at FULL or a PP4 layout and at a PP2 one; every layout meets at
    least two schedules."""
    cases = _matrix_cases()
    assert len(cases) == 17
    for s in SCHEDULES:
        assert {layout[0] for layout, name in cases if name == s} == {2, 4}, s
    for layout in [FULL, *PP4, *PP2]:
        assert sum(where == layout for where, _ in cases) >= 2, layout


# --- the runner's contract -----------------------------------------------------------------------


def runner_contract_case() -> dict:
    """Global loss on every rank; a new batch shape re-plans; a bad batch fails before any collective."""
    pcfg = pu.pcfg_of(pp=2, schedule="1F1B", microbatches=2)
    state = pu.reference_state(ARGS4)
    model = pu.make_model(ARGS4, device="meta")
    pipe = pu.pp_tp.build_pipeline(model, pp_tp.build_mesh(pcfg), pcfg, state_dict=state)
    out = {}
    for name, (n, seq) in {"first": (4, 12), "new_shape": (2, 8)}.items():
        ids, labels = pu.batch(ARGS4, n, seq)
        ref = pu.reference_run(state, ids, labels, ARGS4)["losses"][0]
        for part in pipe.model_parts:
            part.zero_grad()
        out[name] = (pipe.step(ids, labels).item(), ref)
    try:
        pipe.step(torch.zeros(3, 8, dtype=torch.long), torch.zeros(3, 8, dtype=torch.long))
    except ConfigError as e:
        out["error"] = str(e)
    return out


def test_runner_contract(world):
    for r in world(2).run(runner_contract_case):
        for got, ref in (r["first"], r["new_shape"]):
            assert got == pytest.approx(ref, rel=1e-5)
        assert "local batch 3 is not divisible by parallel.microbatches = 2" in r["error"]


def all_padding_on_one_rank_case() -> dict:
    """One DP rank's labels are almost all ignored: the global token mean must still be exact."""
    pcfg = pu.pcfg_of(pp=2, dp_shard=2, schedule="1F1B", microbatches=2)
    state = pu.reference_state(ARGS4)
    ids, labels = pu.batch(ARGS4, 8, 12)
    labels[:4, 1:] = -100  # DP rank 0's half keeps one token per row
    ref = pu.reference_run(state, ids, labels, ARGS4, steps=2)
    got = pu.run_pipeline(pcfg, state, ids, labels, ARGS4, steps=2)
    grad_err = max(pu.rel_err(g, ref["grads"][k]) for k, g in got["grads"].items())
    return {"losses": (got["losses"], ref["losses"]), "grad_err": grad_err}


def test_uneven_padding_across_dp_ranks_is_exact(world):
    for r in world(4).run(all_padding_on_one_rank_case):
        got, ref = r["losses"]
        assert got == pytest.approx(ref, rel=1e-5) and r["grad_err"] < 1e-5, r


def test_zero_bubble_schedules_refuse_resharding_between_input_and_weight_gradients():
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        for policy in ("always", 2):
            with pytest.raises(ConfigError, match="fsdp_reshard_after_forward"):
                check_schedule(2, 2, 4, schedule, policy)
        check_schedule(2, 2, 4, schedule, "default")
    check_schedule(2, 2, 4, "Interleaved1F1B", "always")
