"""Schedule pictures: torch's action orders, the simulated bubble against theory, the trace format, and
the recorder on a real 2-rank step."""

from __future__ import annotations

import parity_utils as pu
import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from pp_tp.diagnostics.timeline import chrome_trace, record_step
from pp_tp.planner.schedule_sim import Span, bubble_fraction, schedule_actions, simulate, theoretical_bubble


@pytest.mark.parametrize(
    "schedule, pp, m, v",
    [
        ("GPipe", 2, 4, 1),
        ("GPipe", 4, 8, 1),
        ("1F1B", 2, 4, 1),
        ("1F1B", 4, 16, 1),
        ("Interleaved1F1B", 2, 4, 2),
        ("Interleaved1F1B", 4, 8, 2),
        ("Interleaved1F1B", 4, 16, 4),
    ],
)
def test_simulated_bubble_is_the_theoretical_one(schedule, pp, m, v):
    bubbles = bubble_fraction(simulate(schedule_actions(schedule, pp, m, v)))
    assert bubbles == pytest.approx([theoretical_bubble(schedule, pp, m, v)] * pp)


def test_1f1b_order_is_torch_runtime_order():
    # torch's 1F1B warms up with (pp - stage) forwards, then alternates B and F
    assert [str(a) for a in schedule_actions("1F1B", 2, 4)[1]] == [
        "1F0",
        "1B0",
        "1F1",
        "1B1",
        "1F2",
        "1B2",
        "1F3",
        "1B3",
    ]
    assert [str(a) for a in schedule_actions("1F1B", 2, 4)[0][:3]] == ["0F0", "0F1", "0B0"]


@pytest.mark.parametrize("schedule", ["LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_every_multi_stage_schedule_simulates(schedule):
    actions = schedule_actions(schedule, 2, 4, 2)
    spans = simulate(actions)
    done = {s.name for s in spans}
    assert all(str(leaf) in done for acts in actions for a in acts for leaf in (a.sub_actions or (a,)))
    assert max(bubble_fraction(spans)) <= theoretical_bubble("1F1B", 2, 4) + 1e-9


def test_csv_schedule_is_read_and_simulated(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    assert bubble_fraction(simulate(schedule_actions(str(path), 2, 2))) == pytest.approx([0.5, 0.5])


def test_chrome_trace_has_a_process_per_rank_and_section():
    spans = [Span(0, "0F0", "compute", 0.0, 0.5), Span(1, "p2p wait", "comm", 0.25, 0.25)]
    trace = chrome_trace([("measured", spans, 1e6), ("simulated", [Span(0, "0F0", "compute", 1.0, 2.0)], 10.0)])
    boxes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["tid"], e["ts"], e["dur"]) for e in boxes] == [
        (0, 0, 0.0, 5e5),
        (1, 1, 2.5e5, 2.5e5),
        (1000, 0, 10.0, 20.0),
    ]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "measured rank 0", 1: "measured rank 1", 1000: "simulated rank 0"}


def _recorded_step(m: int) -> dict:
    pcfg = pu.pcfg_of(pp=2, schedule="1F1B", microbatches=m)
    ids, labels = pu.batch(pu.TINY, 8, 16)
    pipe = pu.run_pipeline(pcfg, pu.reference_state(), ids, labels)["pipe"]  # one step: the warm-up
    original = torch_schedules._wait_batch_p2p
    spans, wall = record_step(pipe.schedule, lambda: pipe.step(ids, labels))
    stage = pipe.schedule._stage
    return {
        "spans": spans,
        "wall": wall,
        "restored": torch_schedules._wait_batch_p2p is original
        and not {"forward_one_chunk", "backward_one_chunk"} & set(vars(stage))
        and "_maybe_compute_loss" not in vars(pipe.schedule),
    }


def test_recorder_sees_every_action_of_a_real_step(world):
    m = 4
    for rank, r in enumerate(world(2).run(_recorded_step, m)):
        names = [s.name for s in r["spans"] if s.kind == "compute"]
        losses = [f"1L{i}" for i in range(m)] if rank == 1 else []
        expected = [f"{rank}{kind}{i}" for kind in "FB" for i in range(m)] + losses
        assert sorted(names) == sorted(expected)
        assert any(s.kind == "comm" for s in r["spans"])
        assert all(0 <= s.start and s.start + s.dur <= r["wall"] for s in r["spans"])
        assert r["restored"]
