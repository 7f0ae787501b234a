"""The trainer's metrics rows: tokens per second, and MFU from the device table (left out when the peak is unknown)."""

from __future__ import annotations

import pytest

from pp_tp.layout import layout_for
from pp_tp.models.reference import ModelArgs, Transformer
from pp_tp.split import cost
from pp_tp.train.metrics import MetricsLogger, flops_per_token, peak_flops


def test_mfu_uses_the_device_table_and_is_left_out_when_the_peak_is_unknown():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and peak_flops("cpu") is None
    row = MetricsLogger("", 1, False, 1e9, 2, 1e12).log(3, False, 2.0, 0.5, 1e-3, tokens=1000, step_time_s=0.5)
    assert row["tokens_per_s"] == 2000 and row["mfu"] == pytest.approx(1.0)  # 1e9 * 2000 / (2 * 1e12)
    assert "mfu" not in MetricsLogger("", 1, False, 1e9, 2, None).log(3, False, 2.0, 0.5, 1e-3, 1000, 0.5)


def test_flops_per_token_count_what_a_token_meets_dense_and_moe():
    """Dense: the analytic formula (6 x matmul weights + 6 x seq x dim per block, head, embedding). MoE: a token
    meets top_k of the n_experts experts' weights, and the router and shared expert whole."""
    seq, dense = 64, ModelArgs(vocab_size=96, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=80)
    model = Transformer(dense)
    d = layout_for(model).dims(model)
    assert flops_per_token(model, layout_for(model), seq) == pytest.approx(
        3 * cost.block_flops(d, seq) + cost.head_flops(d) + cost.embed_flops(d)
    )
    moe_args = ModelArgs(**{**vars(dense), "n_experts": 8, "top_k": 2, "moe_ffn_dim": 24, "n_shared_experts": 1})
    moe = Transformer(moe_args)
    attn = 32 * 8 * (2 * 4 + 2 * 2)  # wq, wo [32, 32]; wk, wv [16, 32]
    per_block = 6 * (attn + 32 * 8 + 3 * 32 * 24 + 2 / 8 * 8 * 3 * 32 * 24) + 6 * seq * 32  # router, shared, experts
    expected = 3 * per_block + cost.head_flops(d) + cost.embed_flops(d)
    assert flops_per_token(moe, layout_for(moe), seq) == pytest.approx(expected)


def test_tensorboard_gets_the_logged_rows_scalars_beside_the_jsonl(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(str(tmp_path / "m.jsonl"), 1, True, 1e9, 2, None, 2, str(tmp_path / "tb"))
    log.log(1, False, 2.5, 0.75, 1e-3, 1000, 0.5, {"data_s": 0.125})
    log.log(2, True, 2.0, 0.5, 5e-4, 1000, 0.25, {"data_s": 0.0625, "val_loss": 2.25})
    out = capsys.readouterr().out
    assert "| data 125.0 ms" in out and "| process max RSS " in out  # the log says what its peak measures
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    values = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert values["train/loss"] == [(1, 2.5), (2, 2.0)] and values["val/loss"] == [(2, 2.25)]
    assert values["perf/data_s"] == [(1, 0.125), (2, 0.0625)] and values["train/grad_norm"] == [(1, 0.75), (2, 0.5)]
    assert {"train/lr", "perf/tokens_per_s", "memory/peak_gib", "perf/step_time_s"} <= set(values)
