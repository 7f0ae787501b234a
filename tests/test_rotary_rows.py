"""Rotary tables one row per batch row only where the family's own forward builds them so (issue 47): Qwen4-Exp's
indexer picks each row's tables by batch index, so its layout builds [B, S, d] tables; Llama's forward hands its
layers one row broadcast over the batch, and so does its layout (B times less memory). The self-check proves both
compositions equal to the family's forward on its small copy (layout_for refuses otherwise)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import family_run  # noqa: E402  (bench/family_run.py: the default configs, repaired where they need it)

from pp_tp.layout import layout_for  # noqa: E402


@pytest.mark.parametrize(("model_type", "per_row"), [("llama", False), ("qwen4_exp_text", True)])
def test_rotary_tables_per_batch_row_only_where_the_forward_builds_them(model_type, per_row):
    model, _ = family_run.reference_model(model_type)
    context = layout_for(model).block_inputs.__self__
    assert context.tables_per_row is per_row
    tables = context.inputs(model, torch.zeros(3, 5, model.config.hidden_size))[2]
    cos = tables[0] if isinstance(tables, tuple) else next(iter(tables.values()))[0]
    assert cos.shape[:2] == ((3 if per_row else 1), 5)
