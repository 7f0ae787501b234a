"""Every Hugging Face decoder-only causal-LM family, through pp_tp on its defaults: exact, refused or wrong.

    python bench/family_sweep.py                                  # all families, table to stdout
    python bench/family_sweep.py --families llama qwen3_next      # some model types
    python bench/family_sweep.py --out docs/family_sweep.md       # the table to a file too

For each decoder-only `model_type` of the installed transformers' causal-LM mapping, with a declared
`base_model_pp_plan` or not (pp_tp then finds the structure from the forward; encoder-decoder and encoder-only types,
those in the seq2seq or masked-LM mappings, are listed as out of scope): its default config shrunk by pp_tp's own
`small_config`, seeded random weights (norm weights near 1, all-zero persistent float buffers such as router biases
stirred), fp32. On 4 gloo ranks (one world for every family) the model's own forward + backward on an 8 x 16 batch
is the reference; `build_pipeline` with default options (pp2 x tp2, 1F1B, 2 microbatches; a dense family that
declares no TP plan pp2 x dp_shard2, since tp > 1 is refused for it by design; MoE families pp2 x dp_shard2 x ep2,
or `--moe-layout dp_shard` / `tp`) runs one `Pipeline.step` on the
same weights and batch. The loss and every full gradient are judged as pp_tp.parity judges a step (its `judge`):
against a float64 run of the plain model, the plain fp32 run being the yardstick, so no tolerance is tuned to one
machine. Each scores err(pipeline, f64) / (FACTOR * err(plain fp32, f64) + floor) and passes at a score <= 1; the
table's "loss score" and "worst grad score" columns are the worst scores over the ranks. Verdicts: exact (loss and
every full gradient pass, persistent buffers equal the plain fp32 run's, parameters covered), refused (the same
one-line ConfigError on every rank), wrong (anything else), skipped (the reference itself could not be built or run,
in fp32 or float64: not pp_tp's doing; the float64 run comes after pp_tp's build, so a refusal still reads as one).
Dropout a default config turns on is set to 0 (the note says so): two builds draw different random masks. Exit code
1 when any family is wrong.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import site
import sys
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from common import World
from harness import RankError
from parity_utils import batch, mesh_for
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
    MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES,
)

import pp_tp
from pp_tp.base.tensors import full_tensor, persistent_buffers
from pp_tp.errors import ConfigError
from pp_tp.models.hf.randomness import is_dropout_key, noise_keys, switch_off_noise
from pp_tp.models.hf.self_check import small_config, stir_zero_buffers
from pp_tp.models.hf.tp_plan import declared_tp_plan
from pp_tp.models.reference.model import ModelArgs
from pp_tp.parallel.tensor_parallel import block_plan
from pp_tp.parallel.tp_styles import TP_STYLES
from pp_tp.parallel.whole_on_tp import whole_on_tp
from pp_tp.parity import FACTOR, FLOOR_ULPS, ReferenceRun, dp_share, floor_for, judge
from pp_tp.parity.lockstep import Judged

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 4
ROWS, SEQ = 8, 16
MIN_POSITIONS = 64
FLOOR = floor_for(torch.float32)  # every build here computes in fp32
CASE_TIMEOUT_S = 300.0
MAX_PARAMS = 10_000_000  # 4 ranks hold two copies each: a family small_config leaves large would not fit
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")
_MOE_SWITCHES = ("enable_moe_block", "is_moe")

# Config values a family's default config leaves broken in transformers' own model (the values its published
# checkpoints use), applied before small_config; each row's note says "config repaired: key=value". Only what the
# plain model needs to build and run, never anything pp_tp would need.
_QSA = dict(indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=256, indexer_budget=8, indexer_compress_ratio=4)
CONFIG_REPAIRS: dict[str, dict[str, Any]] = {
    # rope_parameters left {} while every layer is "full_attention": "KeyError: 'full_attention'" (the rotary reads
    # rope_parameters[layer type]); RoPE at the default base, not checked against CohereLabs/North-Micro-Vision.
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # attn_config without rope_theta: "'DbrxAttentionConfig' object has no attribute 'rope_theta'"; then clip_qkv
    # None: "torch.clamp: At least one of 'min' or 'max' must not be None". dbrx-instruct's values.
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8}},
    # layer_types left None: "'NoneType' object is not subscriptable" (modeling_lfm2_moe.py:474). LFM2's hybrid
    # pattern: short convolutions, a full-attention layer every 4th.
    "lfm2_moe": {"layer_types": ["full_attention" if i % 4 == 2 else "conv" for i in range(32)]},
    # layer_types default to "indexed_attention" with every indexer_* field None: "unsupported operand type(s) for
    # //: 'NoneType' and 'NoneType'" (modeling_qwen4_exp.py:699). The validator's constraints (one key head, head dim
    # >= the rotary dim 256, budget a multiple of the ratio); a budget of 8 tokens, so 16-token rows really select.
    "qwen4_exp": {"text_config": _QSA},
    "qwen4_exp_text": _QSA,
}


class Skip(Exception):
    """The reference model itself could not be built or run: the family is out of the sweep, not pp_tp's fault."""


def out_of_scope(model_type: str) -> str | None:
    """Why a model type is not a decoder-only LM for the sweep, or None when it is one.

    Encoder-decoder and encoder-only families (their causal LM is a seq2seq model's decoder or a masked LM's encoder
    run causally), and multimodal ones whose causal-LM class holds an image or audio encoder besides the decoder (the
    class is built from the whole composite config, not its text config); their text decoders are rows of their own
    where transformers registers one (gemma3 -> gemma3_text)."""
    mappings = (
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES,  # MusicGen: the decoder of a text-conditioned encoder-decoder
    )
    if any(model_type in m for m in mappings):
        return "encoder-decoder or encoder-only"
    if "shared_kv_states" in inspect.signature(_causal_lm_class(model_type).forward).parameters:
        return "draft model: its forward needs another model's embeddings and KV states (shared_kv_states)"
    multimodal = (MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    if any(model_type in m for m in multimodal) and not _text_config_class(model_type):
        return "multimodal: an image or audio encoder beside the decoder"
    return None


def _causal_lm_class(model_type: str) -> type:
    """The causal-LM class transformers maps this type to."""
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def _text_config_class(model_type: str) -> bool:
    """Whether transformers builds this type's causal LM from the text sub-config alone (Llama 4, Qwen3.5: the
    decoder without the vision tower), as `AutoModelForCausalLM.from_config` decides."""
    config_class = CONFIG_MAPPING[model_type]
    text = getattr(config_class, "sub_configs", {}).get("text_config")
    model_class = AutoModelForCausalLM._model_mapping.get(config_class, None)
    return text is not None and getattr(model_class, "config_class", None) is text


def families() -> list[str]:
    """Model types of every decoder-only causal-LM family, with a declared pipeline plan or not."""
    return [t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if out_of_scope(t) is None]


def _class_name(model_type: str) -> str:
    """The mapping's class name, for a family whose model never got built (the built class, when there is one,
    can differ: some model types map onto another family's class)."""
    return str(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ""))


def is_moe(config: Any) -> bool:
    """More than one expert, and no config switch turning its MoE blocks off (Gemma 4's `enable_moe_block`, Doge's
    `is_moe`: their default builds are dense): these run with the MoE layout (`--moe-layout`)."""
    if any(getattr(config, k, None) is False for k in _MOE_SWITCHES):
        return False
    ffn = getattr(config, "ffn_config", None)  # DBRX: the expert count in its FFN sub-config
    counts = [getattr(config, k, None) for k in _EXPERT_COUNTS] + [getattr(ffn, "moe_num_experts", None)]
    return max(c or 0 for c in counts) > 1


# MoE layouts on 4 ranks: experts whole on every rank (pp2 x dp_shard2), split over 2 EP ranks (pp2 x dp_shard2
# x ep2), or TP of experts (pp2 x tp2).
MOE_LAYOUTS = {"dp_shard": dict(pp=2, dp_shard=2, tp=1), "ep": dict(pp=2, dp_shard=2, ep=2), "tp": dict(pp=2, tp=2)}


def parallel_config(config: Any, moe_layout: str = "ep") -> pp_tp.ParallelConfig:
    """pp2 x tp2 for dense families (pp2 x dp_shard2 for those declaring no TP plan); MoE families in `moe_layout`
    (MOE_LAYOUTS)."""
    dense = dict(pp=2, dp_shard=1, tp=2) if declared_tp_plan(config) else MOE_LAYOUTS["dp_shard"]
    shape = MOE_LAYOUTS[moe_layout] if is_moe(config) else dense
    return pp_tp.ParallelConfig(**{"dp_shard": 1, **shape}, schedule="1F1B", microbatches=2, mixed_precision="fp32")


def layout_name(pcfg: pp_tp.ParallelConfig) -> str:
    """How a row names its layout."""
    parts = [f"pp{pcfg.pp}"] + [f"{k}{getattr(pcfg, k)}" for k in ("dp_shard", "ep", "tp") if getattr(pcfg, k) > 1]
    return " ".join(parts)


def _short_path(path: str) -> str:
    for root in (*site.getsitepackages(), REPO):
        if path.startswith(root + os.sep):
            return os.path.relpath(path, root)
    return path


def _one_line(e: BaseException) -> str:
    """Type, first line of the message, the innermost frame and the innermost pp_tp frame: enough to find the
    crash without the traceback."""
    frames = [f"{_short_path(f.filename)}:{f.lineno}" for f in traceback.extract_tb(e.__traceback__)]
    ours = [f for f in frames if f.startswith("pp_tp" + os.sep)]
    where = f" at {frames[-1]}" if frames else ""
    where += f" (in {ours[-1]})" if ours and ours[-1] != frames[-1] else ""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}{where}"


@torch.no_grad()
def _seed_values(model: torch.nn.Module) -> None:
    """Small seeded noise for every parameter (norm weights around 1, so every path carries signal) and for the
    all-zero persistent float buffers (router biases at init), which a dropped or mangled buffer would then show."""
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        norm = leaf == "weight" and "norm" in type(model.get_submodule(owner)).__name__.lower()
        p.copy_(torch.randn(p.shape, generator=gen) * 0.05 + (1.0 if norm else 0.0))
    stir_zero_buffers(model, gen)


def default_config(model_type: str) -> Any:
    """The family's default config, with its `CONFIG_REPAIRS` entry."""
    return CONFIG_MAPPING[model_type](**CONFIG_REPAIRS.get(model_type, {}))


def repair_note(model_type: str) -> str:
    """ "config repaired: key=value, ..." for a type with a `CONFIG_REPAIRS` entry (nested dicts as dotted keys,
    long values cut), else ""."""

    def flat(prefix: str, value: Any) -> list[str]:
        if isinstance(value, dict):
            return [item for k, v in value.items() for item in flat(f"{prefix}{k}.", v)]
        text = repr(value)
        return [f"{prefix[:-1]}={text if len(text) <= 60 else text[:56] + ' ...'}"]

    repairs = CONFIG_REPAIRS.get(model_type)
    return f"config repaired: {', '.join(flat('', repairs))}" if repairs else ""


def reference_model(model_type: str) -> tuple[torch.nn.Module, str]:
    """The family's default config shrunk by pp_tp's `small_config`, fp32, seeded values; and its attention
    implementation (sdpa, else eager). Raises `Skip` when transformers cannot build it."""
    try:
        config = default_config(model_type)
    except Exception as e:  # noqa: BLE001 - a family whose default config does not build is out of the sweep
        raise Skip(f"config: {_one_line(e)}") from e
    if _text_config_class(model_type):  # the decoder alone, as from_config builds it
        config = config.get_text_config()
    try:
        small = small_config(config)
    except Exception as e:  # noqa: BLE001 - pp_tp's shrink failing leaves nothing to compare against
        raise Skip(f"small_config: {_one_line(e)}") from e
    for key in _dropout_keys(small):  # random masks cannot match between two builds: compare without them
        setattr(small, key, 0.0)
    try:
        if getattr(small, "max_position_embeddings", None) is not None:
            small.max_position_embeddings = max(small.max_position_embeddings, MIN_POSITIONS)
    except NotImplementedError:  # XLNet: no position limit, and a setter that raises to say so
        pass
    cls = AutoModelForCausalLM._model_mapping[CONFIG_MAPPING[model_type]]  # from a text config too (Emu3, Mllama)
    try:
        with torch.device("meta"):
            meta, attn = cls._from_config(small, attn_implementation="sdpa"), "sdpa"
    except Exception:  # noqa: BLE001 - sdpa refused: the family's eager attention is its reference
        try:
            with torch.device("meta"):
                meta, attn = cls._from_config(small, attn_implementation="eager"), "eager"
        except Exception as e:  # noqa: BLE001
            raise Skip(f"model: {_one_line(e)}") from e
    n_params = sum(p.numel() for p in meta.parameters())
    if n_params > MAX_PARAMS:
        sizes = {k: sum(p.numel() for p in m.parameters()) for k, m in meta.named_modules() if k.count(".") == 1}
        raise Skip(f"{n_params / 1e6:.0f}M parameters after small_config, most in {max(sizes, key=sizes.get)}")
    torch.manual_seed(0)  # whatever the init draws (then overwritten) is the same on every rank
    model = cls._from_config(small, attn_implementation=attn).float()
    _seed_values(model)
    return model.train(), attn


def _dropout_keys(config: Any) -> list[str]:
    """Config keys with dropout on: in train mode they draw random masks, so the sweep turns them off (noted)."""
    return sorted(k for k, v in config.to_dict().items() if is_dropout_key(k) and isinstance(v, float) and v > 0)


def family_case(model_type: str, moe_layout: str = "ep") -> dict[str, Any]:
    """On this rank: the model's own step on the whole batch, in fp32 and in float64, against one Pipeline.step on
    this rank's share.

    Every failure comes back as data (`skipped`, `refused` or `error`), so one family never ends the world."""
    try:
        model, attn = reference_model(model_type)
    except Skip as e:
        return {"skipped": str(e)}
    config = model.config
    pcfg = parallel_config(config, moe_layout)
    ids, labels = batch(ModelArgs(vocab_size=config.get_text_config().vocab_size), ROWS, SEQ)
    pipelined = copy.deepcopy(model)  # before the reference step, so it holds no gradients
    out: dict[str, Any] = {
        "family": type(model).__name__,
        "layout": layout_name(pcfg),
        "attn": attn,
        "dropout": _dropout_keys(default_config(model_type)),
    }
    noise = noise_keys(model)  # random draws beyond dropout: pp_tp builds with them on, the runs compare without
    out["noise"] = switch_off_noise(model, noise)
    try:
        plain, truth = references(model)
        step_reference(plain, ids, labels)
    except Skip as e:
        return {"skipped": str(e)}
    mesh = mesh_for(pcfg)
    try:
        pipe = pp_tp.build_pipeline(pipelined, mesh, pcfg)
    except ConfigError as e:
        return {**out, "refused": str(e)}
    except Exception as e:  # noqa: BLE001 - a crash inside pp_tp is the sweep's finding
        return {**out, "error": f"build_pipeline: {_one_line(e)}"}
    try:  # after the build: a family pp_tp refuses needs no truth (Inkling2 routes in fp32 whatever the dtype)
        step_reference(truth, ids, labels)
    except Skip as e:
        return {**out, "skipped": str(e)}
    for part in pipe.model_parts:
        switch_off_noise(part, noise)
    try:
        torch.manual_seed(0)
        loss = pipe.step(dp_share(mesh, ids), dp_share(mesh, labels)).item()
        judged = judged_step(pipe, loss, plain, truth)
    except Exception as e:  # noqa: BLE001
        return {**out, "error": f"Pipeline.step: {_one_line(e)}"}
    return {**out, **judged, "mixers": mixer_tp(pipe) if pcfg.tp > 1 else "", "params": sorted(plain.params())}


# The sweep judges one forward + backward; ReferenceRun's step always ends in an optimizer step, this one moves
# nothing.
_NO_UPDATE = lambda params: torch.optim.SGD(params, lr=0.0)  # noqa: E731


def references(model: torch.nn.Module) -> tuple[ReferenceRun, ReferenceRun]:
    """The plain fp32 model and its float64 copy (`ReferenceRun.in_float64`), not yet stepped: the yardstick and
    the truth. Raises `Skip` when the copy fails (not pp_tp's doing)."""
    plain = ReferenceRun(model, _NO_UPDATE)
    try:
        return plain, plain.in_float64()
    except Exception as e:  # noqa: BLE001 - a model that cannot be copied to float64 leaves no truth to judge by
        raise Skip(f"float64 copy: {_one_line(e)}") from e


def step_reference(run: ReferenceRun, ids: torch.Tensor, labels: torch.Tensor) -> None:
    """`run`'s forward + backward on the whole batch; raises `Skip` when it fails (the model's own forward failing,
    in fp32 or float64, is not pp_tp's doing)."""
    try:
        torch.manual_seed(0)
        run.step(ids, labels)
    except Exception as e:  # noqa: BLE001
        dtype = next(run.model.parameters()).dtype
        raise Skip(f"{'float64 ' if dtype == torch.float64 else ''}reference run: {_one_line(e)}") from e


def _grads(run: ReferenceRun) -> dict[str, torch.Tensor]:
    """The run's gradients by canonical name, zeros where none reached (the pipeline's missing ones count the same)."""
    return {k: torch.zeros_like(p) if p.grad is None else p.grad for k, p in run.model.named_parameters()}


def judged_step(pipe: pp_tp.Pipeline, loss: float, plain: ReferenceRun, truth: ReferenceRun) -> dict[str, Any]:
    """This rank's share of the verdict after `pipe`'s step (pp_tp.parity's `judge` at the fp32 floor): the loss and
    the worst of its full gradients against the float64 truth, the plain fp32 run the yardstick; the parameters it
    covers (canonical names); the persistent buffers that differ from the plain run's at all."""
    want, true = _grads(plain), _grads(truth)
    ref_buffers = dict(plain.model.named_buffers())
    got, keys, bad_buffers = {}, {}, []
    for i, part in enumerate(pipe.model_parts):
        for local, p in part.named_parameters():
            keys[f"{i}.{local}"] = key = part.checkpoint_keys[local]  # stage-qualified: a tied copy is its own
            got[f"{i}.{local}"] = torch.zeros_like(want[key]) if p.grad is None else full_tensor(p.grad)
        for name, b in persistent_buffers(part).items():
            b, ref = full_tensor(b), ref_buffers.get(name)
            if ref is None or b.shape != ref.shape or not torch.equal(b, ref):
                bad_buffers.append(name)
    scalar = lambda x: {"loss": torch.tensor(x, dtype=torch.float64)}  # noqa: E731
    return {
        "loss": judge(scalar(loss), scalar(plain.losses[-1]), scalar(truth.losses[-1]), {}, FLOOR),
        "grads": judge(got, want, true, keys, FLOOR),
        "covered": sorted(set(keys.values())),
        "bad_buffers": bad_buffers,
    }


def mixer_tp(pipe: pp_tp.Pipeline) -> str:
    """How TP treats this rank's block children beyond the Megatron pair: split by heads with a mixer record
    (gated delta nets, Mamba2), or run whole on every TP rank (what the startup report names)."""
    split = sorted(
        {
            f"{rule} ({style})"
            for part in pipe.model_parts
            for block in part.block_modules()
            for rule, style in block_plan(block, part.layout).items()
            if TP_STYLES[style].splits_mixer
        }
    )
    whole = [f"{name} ({'/'.join(classes)})" for name, (classes, _) in whole_on_tp(pipe.model_parts).items()]
    parts = [f"split by heads: {', '.join(split)}"] if split else []
    return "; ".join(parts + ([f"whole: {', '.join(whole)}"] if whole else []))


@dataclass
class Row:
    """One family's line of the table."""

    model_type: str
    family: str
    layout: str
    verdict: str  # exact | refused | wrong | skipped
    loss_score: float | None = None  # the pipelined loss's score against the float64 truth (passes at <= 1)
    grad_score: float | None = None  # the worst full gradient's score, over every rank
    mixers: str = ""
    note: str = ""


def classify(model_type: str, per_rank: Sequence[dict[str, Any]]) -> Row:
    """One verdict from every rank's answer: exact and refused need all ranks to agree, everything else is wrong."""
    first = per_rank[0]
    row = Row(model_type, first.get("family") or _class_name(model_type), first.get("layout", ""), "wrong")
    kinds = [next((k for k in ("skipped", "refused", "error") if k in r), "ran") for r in per_rank]
    if set(kinds) == {"skipped"} and len({r["skipped"] for r in per_rank}) == 1:
        row.verdict, row.note = "skipped", first["skipped"]
        return row
    if set(kinds) == {"refused"} and len({r["refused"] for r in per_rank}) == 1:
        row.verdict, row.note = "refused", first["refused"][:100]
        return row
    if set(kinds) != {"ran"}:
        rank, r = next((i, r) for i, r in enumerate(per_rank) if kinds[i] != "ran")
        why = r.get("error") or r.get("refused") or r.get("skipped")
        row.note = f"ranks answered {kinds}; rank {rank}: {why}" if len(set(kinds)) > 1 else f"rank {rank}: {why}"
        return row
    loss = max((r["loss"] for r in per_rank), key=lambda j: j.score)
    grads = max((r["grads"] for r in per_rank), key=lambda j: j.score)
    row.loss_score, row.grad_score = loss.score, grads.score
    missing = sorted(set(first["params"]) - {k for r in per_rank for k in r["covered"]})
    bad_buffers = sorted({b for r in per_rank for b in r["bad_buffers"]})
    problems = [_off("loss", loss)] if not loss.passed else []
    problems += [_off(f"worst grad {grads.name}", grads)] if not grads.passed else []
    if bad_buffers:
        problems.append(f"buffers differ: {', '.join(bad_buffers[:3])}" + (" ..." if len(bad_buffers) > 3 else ""))
    if missing:
        problems.append(f"params on no rank: {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))
    context = [f"{first['attn']} attention"] if first["attn"] != "sdpa" else []
    context += [f"dropout set to 0 for the comparison: {', '.join(first['dropout'])}"] if first["dropout"] else []
    noise = first.get("noise")
    context += (
        [f"random draws beyond dropout set to 0 for the comparison (built with them on): {', '.join(noise)}"]
        if noise
        else []
    )
    row.mixers = first["mixers"]
    row.verdict = "wrong" if problems else "exact"
    row.note = "; ".join(problems + context)
    return row


def _off(what: str, j: Judged) -> str:
    """A failed score in words: how far the pipelined run is from float64, against the plain fp32 run's distance."""
    return f"{what} {j.score:.3g}x its bound: {j.pipe:.1e} off float64 (plain fp32 {j.plain:.1e})"


def sweep(names: Sequence[str], world: World, moe_layout: str = "ep") -> list[Row]:
    """Every family in `names` on the `WORLD`-rank `world`, one case each; after a rank crash or an exception
    inside pp_tp the world restarts, so later families start from clean process groups."""
    rows = []
    for i, name in enumerate(names):
        start = time.perf_counter()
        try:
            # A world started by another caller (the tests' session world) has no bench/ on its ranks' path.
            world.run(site.addsitedir, os.path.dirname(os.path.abspath(__file__)))
            row = classify(name, world.run(family_case, name, moe_layout, timeout=CASE_TIMEOUT_S))
        except RankError as e:  # the world is gone already; the next run starts a fresh one
            row = Row(name, _class_name(name), "", "wrong", note=f"rank crash: {str(e).splitlines()[0]}")
        row.note = "; ".join(filter(None, (row.note, repair_note(name))))
        if row.verdict == "wrong" and row.loss_score is None:  # an exception: a collective may have stopped midway
            world.close()  # so the next family starts on fresh process groups
        rows.append(row)
        print(f"[{i + 1}/{len(names)}] {name}: {row.verdict} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return rows


def markdown(rows: Sequence[Row]) -> str:
    """The table, then one line of counts per verdict."""
    fmt = lambda x: "" if x is None else f"{x:.2g}"  # noqa: E731
    lines = [
        f"Made by `python bench/family_sweep.py --out docs/family_sweep.md` (torch {torch.__version__}, "
        f"transformers {transformers.__version__}, 4 gloo ranks). Loss score, worst grad score: the pipelined "
        f"value's distance to a float64 run of the plain model over ({FACTOR:g} x the plain fp32 run's distance + "
        f"{FLOOR_ULPS} fp32 ulps), worst over the ranks; exact needs both <= 1 (pp_tp.parity's verdict).",
        "",
        "| family | model type | layout | verdict | loss score | worst grad score | TP of mixers | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        note = r.note.replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {r.family} | {r.model_type} | {r.layout} | {r.verdict} | {fmt(r.loss_score)} | {fmt(r.grad_score)} "
            f"| {r.mixers} | {note} |"
        )
    counts = Counter(r.verdict for r in rows)
    lines.append("")
    lines.append(", ".join(f"{counts[v]} {v}" for v in ("exact", "refused", "wrong", "skipped")))
    scope: dict[str, list[str]] = {}
    for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if (why := out_of_scope(t)) is not None:
            scope.setdefault(why, []).append(t)
    lines += [""] + [f"Out of scope ({why}, {len(ts)}): {', '.join(ts)}." for why, ts in scope.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", metavar="MODEL_TYPE", help="model types (default: every family)")
    parser.add_argument("--moe-layout", choices=sorted(MOE_LAYOUTS), default="ep", help="how MoE families run")
    parser.add_argument("--out", help="also write the Markdown table to this file")
    a = parser.parse_args()
    names = a.families or families()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # the ranks inherit it: progress lines stay readable
    world = World(WORLD)
    try:
        rows = sweep(names, world, a.moe_layout)
    finally:
        world.close()
    text = markdown(rows)
    print(text, end="")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    sys.exit(1 if any(r.verdict == "wrong" for r in rows) else 0)


if __name__ == "__main__":
    main()
