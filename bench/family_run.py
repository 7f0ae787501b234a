"""One family's case on one rank of bench/family_sweep.py: the seeded small reference model, its fp32 and float64
steps, one `Pipeline.step` of pp_tp's build on the same weights and batch, and this rank's share of the verdict."""

from __future__ import annotations

import copy
import os
import site
import traceback
from typing import Any

import common  # noqa: F401  (puts tests/ on the path: parity_utils)
import torch
from family_catalog import default_config, layout_name, parallel_config, text_config_class
from family_float64 import float64_column
from parity_utils import batch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import pp_tp
from pp_tp.base.tensors import full_tensor, persistent_buffers
from pp_tp.errors import ConfigError
from pp_tp.models.hf.randomness import noise_keys, switch_off_noise
from pp_tp.models.hf.record import is_dropout_key, seeded_values
from pp_tp.models.hf.small import small_config
from pp_tp.models.reference.model import ModelArgs
from pp_tp.parallel.tensor_parallel import block_plan
from pp_tp.parallel.tp_styles import TP_STYLES
from pp_tp.parallel.whole_on_tp import whole_on_tp
from pp_tp.parity import ReferenceRun, dp_share, floor_for, judge

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROWS, SEQ = 8, 16

MIN_POSITIONS = 64

FLOOR = floor_for(torch.float32)  # every build here computes in fp32

MAX_PARAMS = 10_000_000  # 4 ranks hold two copies each: a family small_config leaves large would not fit


class Skip(Exception):
    """The reference model itself could not be built or run: the family is out of the sweep, not pp_tp's fault."""


def _short_path(path: str) -> str:
    for root in (*site.getsitepackages(), REPO):
        if path.startswith(root + os.sep):
            return os.path.relpath(path, root)
    return path


def one_line(e: BaseException) -> str:
    """Type, first line of the message, the innermost frame and the innermost pp_tp frame: enough to find the
    crash without the traceback."""
    frames = [f"{_short_path(f.filename)}:{f.lineno}" for f in traceback.extract_tb(e.__traceback__)]
    ours = [f for f in frames if f.startswith("pp_tp" + os.sep)]
    where = f" at {frames[-1]}" if frames else ""
    where += f" (in {ours[-1]})" if ours and ours[-1] != frames[-1] else ""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}{where}"


def reference_model(model_type: str) -> tuple[torch.nn.Module, str]:
    """The family's default config shrunk by pp_tp's `small_config`, fp32, seeded values; and its attention
    implementation (sdpa, else eager). Raises `Skip` when transformers cannot build it."""
    try:
        config = default_config(model_type)
    except Exception as e:  # noqa: BLE001 - a family whose default config does not build is out of the sweep
        raise Skip(f"config: {one_line(e)}") from e
    if text_config_class(model_type):  # the decoder alone, as from_config builds it
        config = config.get_text_config()
    try:
        small = small_config(config)
    except Exception as e:  # noqa: BLE001 - pp_tp's shrink failing leaves nothing to compare against
        raise Skip(f"small_config: {one_line(e)}") from e
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
            raise Skip(f"model: {one_line(e)}") from e
    n_params = sum(p.numel() for p in meta.parameters())
    if n_params > MAX_PARAMS:
        sizes = {k: sum(p.numel() for p in m.parameters()) for k, m in meta.named_modules() if k.count(".") == 1}
        raise Skip(f"{n_params / 1e6:.0f}M parameters after small_config, most in {max(sizes, key=sizes.get)}")
    torch.manual_seed(0)  # whatever the init draws (then overwritten) is the same on every rank
    model = cls._from_config(small, attn_implementation=attn).float()
    seeded_values(model, 0, zero_buffers=True)
    return model.train(), attn


def _dropout_keys(config: Any) -> list[str]:
    """Config keys with dropout on: in train mode they draw random masks, so the sweep turns them off (noted)."""
    return sorted(k for k, v in config.to_dict().items() if is_dropout_key(k) and isinstance(v, float) and v > 0)


def family_case(model_type: str, moe_layout: str = "ep", float64: bool = False) -> dict[str, Any]:
    """On this rank: the model's own step on the whole batch, in fp32 and in float64, against one Pipeline.step on
    this rank's share; with `float64`, also the float64 column (bench/family_float64.py).

    Every failure comes back as data (`skipped`, `refused` or `error`), so one family never ends the world."""
    try:
        model, attn = reference_model(model_type)
    except Skip as e:
        return {"skipped": str(e)}
    config = model.config
    pcfg = parallel_config(config, moe_layout)
    ids, labels = batch(ModelArgs(vocab_size=config.get_text_config().vocab_size), ROWS, SEQ)
    pipelined = copy.deepcopy(model)  # before the reference step, so it holds no gradients
    fresh = copy.deepcopy(model) if float64 else None  # the float64 column's, built with noise on like `pipelined`
    out: dict[str, Any] = {
        "family": type(model).__name__,
        "layout": layout_name(pcfg),
        "attn": attn,
        "dropout": _dropout_keys(default_config(model_type)),
    }
    try:  # pp_tp's analysis of the family: a refusal here is the build's refusal (the same line on every rank)
        noise = noise_keys(model)  # random draws beyond dropout: pp_tp builds with them on, the runs compare without
    except ConfigError as e:
        return {**out, "refused": str(e)}
    out["noise"] = switch_off_noise(model, noise)
    try:
        plain, truth = references(model)
        step_reference(plain, ids, labels)
    except Skip as e:
        return {"skipped": str(e)}
    mesh = pp_tp.build_mesh(pcfg)
    try:
        pipe = pp_tp.build_pipeline(pipelined, mesh, pcfg)
    except ConfigError as e:
        return {**out, "refused": str(e)}
    except Exception as e:  # noqa: BLE001 - a crash inside pp_tp is the sweep's finding
        return {**out, "error": f"build_pipeline: {one_line(e)}"}
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
        return {**out, "error": f"Pipeline.step: {one_line(e)}"}
    out = {**out, **judged, "mixers": mixer_tp(pipe) if pcfg.tp > 1 else "", "params": sorted(plain.params())}
    return {**out, **float64_column(fresh, pcfg, ids, labels, noise, one_line, _NO_UPDATE)} if fresh else out


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
        raise Skip(f"float64 copy: {one_line(e)}") from e


def step_reference(run: ReferenceRun, ids: torch.Tensor, labels: torch.Tensor) -> None:
    """`run`'s forward + backward on the whole batch; raises `Skip` when it fails (the model's own forward failing,
    in fp32 or float64, is not pp_tp's doing)."""
    try:
        torch.manual_seed(0)
        run.step(ids, labels)
    except Exception as e:  # noqa: BLE001
        dtype = next(run.model.parameters()).dtype
        raise Skip(f"{'float64 ' if dtype == torch.float64 else ''}reference run: {one_line(e)}") from e


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
