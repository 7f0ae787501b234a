"""The trainer's LR schedule: linear warmup, then cosine decay to training.min_lr_ratio."""

from __future__ import annotations

import itertools

import pytest

from pp_tp.train.trainer import lr_factor


def test_lr_warms_up_linearly_then_decays_by_cosine_to_min_ratio():
    f = [lr_factor(s, warmup=4, total=12, min_ratio=0.1) for s in range(13)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == 1.0 and f[8] == pytest.approx(0.55) and f[12] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(f[4:]))
