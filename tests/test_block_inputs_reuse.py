"""StageModule.reuse_block_inputs: block inputs computed once per microbatch shape, outputs unchanged."""

from __future__ import annotations

from dataclasses import replace

import parity_utils as pu
import torch

from pp_tp.config import ParallelConfig, resolve_parallel
from pp_tp.layout import layout_for
from pp_tp.models.reference import REFERENCE
from pp_tp.models.reference.model import Transformer
from pp_tp.split.plan import plan_stages
from pp_tp.stages.stage_module import StageModule


def _stage(layout):
    model = Transformer(pu.TINY)
    model.init_weights(0)
    pcfg = resolve_parallel(ParallelConfig(pp=2, microbatches=4, schedule="GPipe"), world_size=2)
    plan = plan_stages(model, layout_for(model), pcfg)
    return StageModule(model, layout, plan.stages[0])


def test_block_inputs_once_per_shape_and_outputs_equal():
    calls = []

    def counting(stage, h):
        calls.append(tuple(h.shape))
        return REFERENCE.block_inputs(stage, h)

    stage = _stage(replace(REFERENCE, block_inputs=counting))
    ids = [torch.randint(0, pu.TINY.vocab_size, (2, 8)) for _ in range(3)] + [torch.randint(0, 4, (1, 8))]
    plain = [stage(x) for x in ids]
    assert len(calls) == 4
    calls.clear()
    with stage.reuse_block_inputs():
        reused = [stage(x) for x in ids]
    assert calls == [(2, 8, pu.TINY.dim), (1, 8, pu.TINY.dim)]  # one per shape
    for a, b in zip(plain, reused):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    stage(ids[0])  # outside the context: computed again, nothing kept
    assert len(calls) == 3


def test_block_inputs_that_require_grad_are_never_reused():
    calls = []

    def grad_extras(stage, h):
        calls.append(1)
        return (stage.rope, h.sum() * 0)  # built from h's values: must not cross microbatches

    stage = _stage(replace(REFERENCE, block_inputs=grad_extras, call_block=lambda b, h, e, i: b(h, e[0]) + e[1]))
    with stage.reuse_block_inputs():
        for _ in range(3):
            stage(torch.randint(0, pu.TINY.vocab_size, (2, 8))).sum().backward()
    assert len(calls) == 3
