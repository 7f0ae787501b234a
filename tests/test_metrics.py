"""The trainer's metrics rows: tokens per second, and MFU from the device table (left out when the peak is unknown)."""

from __future__ import annotations

import pytest

from pp_tp.train.metrics import MetricsLogger, peak_flops


def test_mfu_uses_the_device_table_and_is_left_out_when_the_peak_is_unknown():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and peak_flops("cpu") is None
    row = MetricsLogger("", 1, False, 1e9, 2, 1e12).log(3, False, 2.0, 0.5, 1e-3, tokens=1000, step_time_s=0.5)
    assert row["tokens_per_s"] == 2000 and row["mfu"] == pytest.approx(1.0)  # 1e9 * 2000 / (2 * 1e12)
    assert "mfu" not in MetricsLogger("", 1, False, 1e9, 2, None).log(3, False, 2.0, 0.5, 1e-3, 1000, 0.5)
