"""PipelineTrainer (pp_tp.integrations.hf_trainer) against transformers.Trainer on one process.

A 4-layer HF Llama on fixed random tokens, Trainer's arguments of issue 50; the reference Trainer runs in the test
process (CPU, fp32), PipelineTrainer on 4 gloo ranks at pp2 x tp2 and pp2 x dp2 (whose global step holds dp times
the rows: the reference reads per_device_train_batch_size x dp, as DDP Trainer would). Logged losses and grad norms
per step within 1e-5 relative; the saved model loads with from_pretrained equal to the reference's within 1e-4 per
tensor; a Qwen3-MoE at pp2 x ep2; a resume from the reference's checkpoint at another layout; refusals in one line.
"""

from __future__ import annotations

import json
import os

import hf_utils as hu
import parity_utils as pu
import pytest
import torch

import pp_tp
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


def _eval(trainer) -> list[tuple[float, float]]:
    """The eval loss of 24 rows, as a (loss, 1.0) entry after the logged steps."""
    return [(trainer.evaluate(_data(trainer.model.config.vocab_size)[:24])["eval_loss"], 1.0)]


def reference(out: str, model_fn=_llama, resume: str | None = None, **kw) -> tuple[list, dict]:
    """transformers.Trainer on one process: (loss, grad norm) per step then (eval loss of 24 rows, 1), and the
    trained parameters."""
    from transformers import Trainer

    model = model_fn()
    trainer = Trainer(model, _args(out, **kw), train_dataset=_data(model.config.vocab_size))
    trainer.train(resume_from_checkpoint=resume)
    return _history(trainer) + _eval(trainer), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _qwen3_moe():
    import test_hf_families as fam

    torch.manual_seed(0)
    return fam.make("qwen3_moe")


def pipeline_case(out: str, parallel: dict, model_fn=_llama, resume: str | None = None, meta_from: str | None = None,
                  fresh: bool = True, **kw) -> dict:  # fmt: skip
    """Per rank: the logged (loss, grad norm) per step of a PipelineTrainer run and its eval loss, its model saved to
    `out`/model; with `resume` the steps of a run resuming from that checkpoint (without `fresh` the only run: its
    eval loss and saved model stand for the fresh run's); with `meta_from` the eval loss of a PipelineTrainer given a
    meta model of that directory."""
    from pp_tp.integrations.hf_trainer import PipelineTrainer

    pcfg = pu.pcfg_of(**parallel)

    def run(output_dir: str, resume_from: str | None) -> PipelineTrainer:
        model = model_fn()
        trainer = PipelineTrainer(model, _args(output_dir, **kw), train_dataset=_data(model.config.vocab_size),
                                  parallel=pcfg, mesh=pp_tp.build_mesh(pcfg))  # fmt: skip
        trainer.train(resume_from_checkpoint=resume_from)
        return trainer

    result = {}
    if resume is not None:
        resumed = run(out + "_resumed", resume)
        result["resumed"] = _history(resumed)
    trainer = run(out, None) if fresh else resumed
    trainer.save_model(os.path.join(out, "model"))
    result["history"] = (_history(trainer) if fresh else []) + _eval(trainer)
    if meta_from is not None:  # a meta model whose config names its checkpoint: each rank reads its slices
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(meta_from), attn_implementation="sdpa")
        trainer = PipelineTrainer(meta, _args(out + "_meta", **kw), parallel=pcfg, mesh=pp_tp.build_mesh(pcfg))
        result["meta_eval"] = _eval(trainer)
    return result


def _close(got: list, want: list, tol: float = 1e-5) -> None:
    assert len(got) == len(want) and got, (got, want)
    for (gl, gn), (wl, wn) in zip(got, want):
        assert abs(gl - wl) <= tol * abs(wl), (got, want)
        assert abs(gn - wn) <= tol * abs(wn), (got, want)


def _check_saved(path: str, params: dict, load=None) -> None:
    saved = (load or hu.from_pretrained)(path).state_dict()
    assert saved.keys() == params.keys()
    worst = max(rel_err(saved[k], v) for k, v in params.items())
    assert worst <= 1e-4, worst


def _optimizer_err(got: str, want: str) -> float:
    """Worst relative error over the state tensors of two Trainer optimizer.pt files (same numbering)."""
    a, b = (torch.load(os.path.join(p, "optimizer.pt"), weights_only=True) for p in (got, want))
    assert a["state"].keys() == b["state"].keys() and len(a["param_groups"]) == len(b["param_groups"]) == 2
    for ga, gb in zip(a["param_groups"], b["param_groups"]):
        assert ga["params"] == gb["params"] and ga["weight_decay"] == gb["weight_decay"] and ga["lr"] == gb["lr"]
    return max(rel_err(a["state"][i][k], v) for i, s in b["state"].items() for k, v in s.items() if v.dim())


def test_trainer_pp2_tp2(world, tmp_path):
    """pp2 x tp2 against Trainer; its step-2 checkpoint is a Trainer checkpoint: optimizer.pt equal to Trainer's, and
    one-process Trainer resumes from it (another layout) with the reference's steps 3 and 4."""
    saving = dict(save_strategy="steps", save_steps=2)
    ref = str(tmp_path / "ref")
    want, params = reference(ref, **saving)
    out = str(tmp_path / "pipe")
    got = world(4).run(pipeline_case, out, dict(pp=2, tp=2), meta_from=os.path.join(ref, "checkpoint-4"), **saving)
    for g in got:
        _close(g["history"], want)
        _close(g["meta_eval"], want[-1:])
    _check_saved(os.path.join(out, "model"), params)
    assert _optimizer_err(os.path.join(out, "checkpoint-2"), os.path.join(ref, "checkpoint-2")) <= 1e-4
    resumed, resumed_params = reference(str(tmp_path / "ref_resumed"), resume=os.path.join(out, "checkpoint-2"))
    _close(resumed[2:], want[2:])
    assert max(rel_err(resumed_params[k], v) for k, v in params.items()) <= 1e-4


def test_trainer_pp2_dp2_and_moe(world, tmp_path):
    """pp2 x dp2 against Trainer reading dp x the rows per batch, resuming from that Trainer's step-2 checkpoint (one
    process -> pp2 x dp2: steps 3 and 4, the eval loss and the saved model); a Qwen3-MoE at pp2 x ep2 (dp_shard 2)
    likewise, and also trained from its first step. (A Llama trained from its first step at pp2 x dp2 against
    Trainer at dp x the rows: test_trl_sft, through the same PipelineTrainerMixin.)"""
    saving = dict(save_strategy="steps", save_steps=2)
    for name, model_fn, parallel in [("llama", _llama, dict(pp=2, dp_shard=2)),
                                     ("moe", _qwen3_moe, dict(pp=2, dp_shard=2, ep=2))]:  # fmt: skip
        ref = str(tmp_path / f"ref_{name}")
        want, params = reference(ref, model_fn, per_device_train_batch_size=8, per_device_eval_batch_size=16, **saving)
        out = str(tmp_path / f"pipe_{name}")
        resume, fresh = os.path.join(ref, "checkpoint-2"), name == "moe"
        got = world(4).run(pipeline_case, out, parallel, model_fn, resume=resume, fresh=fresh)
        for g in got:
            _close(g["history"], want if fresh else want[-1:])
            _close(g["resumed"][2:], want[2:4])  # the first two: the checkpoint's log
        _check_saved(os.path.join(out, "model"), params, None if name == "llama" else _load_moe)


def _load_moe(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_parallel_config_and_refusals(tmp_path):
    """Trainer's arguments in the [parallel] config; what cannot run under a pipeline: one line naming it, before
    any process group or build."""
    from pp_tp.integrations.hf_trainer import PipelineTrainer, parallel_config

    pcfg = parallel_config(dict(pp=2), _args(str(tmp_path), bf16=True, gradient_checkpointing=True))
    assert (pcfg.microbatches, pcfg.mixed_precision, pcfg.activation_checkpoint) == (2, "bf16", "full")
    pcfg = parallel_config(dict(pp=2, microbatches=4, activation_checkpoint="selective"), _args(str(tmp_path)))
    assert (pcfg.microbatches, pcfg.mixed_precision, pcfg.activation_checkpoint) == (4, "fp32", "selective")

    cases = [
        (dict(fp16=True), {}, "fp16"),
        (dict(torch_compile=True), {}, "torch_compile"),
        (dict(fsdp=True), {}, "fsdp"),
        (dict(optim="adafactor"), {}, "optim=adafactor"),
        (dict(label_smoothing_factor=0.1), {}, "label_smoothing_factor"),
        ({}, dict(compute_metrics=lambda p: {}), "compute_metrics"),
        ({}, dict(optimizers=(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0), None)), "optimizers"),
        (dict(per_device_train_batch_size=3, gradient_accumulation_steps=1), dict(parallel=dict(microbatches=2)),
         "parallel.microbatches = 2"),
    ]  # fmt: skip
    model = _llama()
    for args, kw, needle in cases:
        with pytest.raises(ConfigError, match=needle) as e:
            PipelineTrainer(model, _args(str(tmp_path), **args), **{"parallel": dict(pp=2), **kw})
        assert "\n" not in str(e.value)


def _chat_file(path: str) -> str:
    """A small prompt/completion chat dataset (JSON lines) of random words, ragged lengths."""
    gen = torch.Generator().manual_seed(2)

    def words(lo: int, hi: int) -> str:
        n = int(torch.randint(lo, hi, (1,), generator=gen))
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 80, (n,), generator=gen))

    with open(path, "w") as f:
        for _ in range(ROWS):
            prompt, completion = (
                [{"role": "user", "content": words(2, 6)}],
                [{"role": "assistant", "content": words(2, 9)}],
            )
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return path


def _sft_parts(path: str):
    """The dataset and a word-level tokenizer with a chat template, built here (nothing downloaded)."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["user", "assistant", ":", "<eos>", "<pad>", "<unk>"] + [f"w{i}" for i in range(80)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
    with open(path) as f:
        return Dataset.from_list([json.loads(line) for line in f]), tokenizer


def _sft_args(out: str, **kw):
    from trl import SFTConfig

    return SFTConfig(output_dir=out, max_length=32, bf16=False, **{**ARGS, **kw})  # TRL defaults to bf16


def sft_case(out: str, data: str, parallel: dict) -> list:
    from pp_tp.integrations.hf_sft import PipelineSFTTrainer

    pcfg = pu.pcfg_of(**parallel)
    dataset, tokenizer = _sft_parts(data)
    trainer = PipelineSFTTrainer(_llama(), _sft_args(out), train_dataset=dataset, processing_class=tokenizer,
                                 parallel=pcfg, mesh=pp_tp.build_mesh(pcfg))  # fmt: skip
    trainer.train()
    return _history(trainer)


def test_trl_sft(world, tmp_path):
    """TRL's SFTTrainer (completion-only labels, ragged right-padded rows) against PipelineSFTTrainer at pp2 x dp2."""
    from trl import SFTTrainer

    data = _chat_file(str(tmp_path / "chat.jsonl"))
    dataset, tokenizer = _sft_parts(data)
    ref = SFTTrainer(_llama(), _sft_args(str(tmp_path / "ref"), per_device_train_batch_size=8),
                     train_dataset=dataset, processing_class=tokenizer)  # fmt: skip
    ref.train()
    want = _history(ref)
    for got in world(4).run(sft_case, str(tmp_path / "pipe"), data, dict(pp=2, dp_shard=2)):
        _close(got, want)
