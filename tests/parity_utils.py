"""Shared pieces of the multi-rank parity tests: the same weights and batch everywhere, the non-PP
reference computed on every rank, and comparisons of loss, full gradients and updated parameters."""

from __future__ import annotations

import copy
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F
from torch import nn

import pp_tp
from pp_tp.config import ModelConfig, ParallelConfig
from pp_tp.models.factory import build_model
from pp_tp.models.reference.model import ModelArgs
from pp_tp.parallel.grads import clip_grad_norm_
from pp_tp.tensor_utils import full_tensor, persistent_buffers

_MESHES: dict = {}

TINY = ModelArgs(vocab_size=96, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=32)
# AdamW eps above the fp32 roundoff of a gradient element (~1e-9 here): with 1e-8, an element whose gradient is
# nearly zero turns summation-order noise (TP all-reduces) into a full-size update and params drift by ~3e-5.
ADAM_EPS = 1e-6


def mesh_for(pcfg: ParallelConfig):
    """Meshes are cached per shape: creating gloo groups for every case would dominate the run time."""
    key = (pcfg.pp, pcfg.dp_replicate, pcfg.dp_shard, pcfg.tp)
    if key not in _MESHES:
        _MESHES[key] = pp_tp.build_mesh(pcfg)
    return _MESHES[key]


def pcfg_of(**kw) -> ParallelConfig:
    kw.setdefault("mixed_precision", "fp32")
    kw.setdefault("dp_shard", 1)
    return ParallelConfig(**kw)


def make_hf_llama(args: ModelArgs, device: str = "cpu") -> nn.Module:
    return make_model(args, hf=True, device=device)


def make_model(args: ModelArgs = TINY, hf: bool = False, device: str = "cpu") -> nn.Module:
    return build_model(ModelConfig(**asdict(args), kind="hf_llama" if hf else "reference"), device)


def reference_state(args: ModelArgs = TINY, hf: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random full weights by FQN, with non-trivial norms and biases so every path is exercised."""
    gen = torch.Generator().manual_seed(seed)
    model = make_model(args, hf)
    return {
        k: (
            torch.randn(v.shape, generator=gen) * (0.1 if k.endswith("bias") else 0.05)
            + (1.0 if k.endswith("norm.weight") else 0.0)
        )
        for k, v in model.named_parameters()  # a tied weight once, under its canonical name
    }


def batch(args: ModelArgs, n: int, seq: int, seed: int = 1, pad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and aligned labels; with `pad`, rows carry different amounts of -100 so microbatches differ."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, args.vocab_size, (n, seq), generator=gen)
    labels = torch.randint(0, args.vocab_size, (n, seq), generator=gen)
    if pad:
        for i in range(n):
            cut = (i * 5 + 3) % seq
            labels[i, seq - cut :] = -100
    return ids, labels


def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def reference_run(
    state: dict,
    ids: torch.Tensor,
    labels: torch.Tensor,
    args: ModelArgs = TINY,
    hf: bool = False,
    steps: int = 1,
    lr: float = 1e-3,
    max_norm: float | None = None,
) -> dict:
    """The single-process, non-PP build: loss, gradients and params after `steps` AdamW steps."""
    torch.manual_seed(0)
    model = make_model(args, hf)
    model.load_state_dict(state, strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, eps=ADAM_EPS)
    losses, grads, norms = [], None, []
    for i in range(steps):
        opt.zero_grad()
        logits = logits_of(model, ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        loss.backward()
        losses.append(loss.item())
        if i == 0:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    buffers = {k: b.detach().clone() for k, b in persistent_buffers(model).items()}
    return {"losses": losses, "grads": grads, "params": params, "norms": norms, "buffers": buffers}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


def run_pipeline(
    pcfg: ParallelConfig,
    state: dict,
    ids: torch.Tensor,
    labels: torch.Tensor,
    args: ModelArgs = TINY,
    hf: bool = False,
    steps: int = 1,
    lr: float = 1e-3,
    max_norm: float | None = None,
) -> dict:
    """The pipelined build on the same weights and batch; each DP rank takes its slice of the batch."""
    mesh = mesh_for(pcfg)
    model = make_model(args, hf, device="meta")
    pipe = pp_tp.build_pipeline(model, mesh, pcfg, state_dict=state)
    dp_rank = mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size() + mesh["dp_shard"].get_local_rank()
    per = ids.shape[0] // pcfg.dp
    ids, labels = ids[dp_rank * per : (dp_rank + 1) * per], labels[dp_rank * per : (dp_rank + 1) * per]
    params = [p for part in pipe.model_parts for p in part.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.1, eps=ADAM_EPS)
    losses, grads, norms = [], None, []
    for i in range(steps):
        opt.zero_grad()
        losses.append(pipe.step(ids, labels).item())
        if i == 0:
            grads = {
                k: full_tensor(p.grad).detach().clone() for part in pipe.model_parts for k, p in part.named_parameters()
            }
        if max_norm is not None:
            norms.append(float(clip_grad_norm_(pipe.model_parts, max_norm, mesh)))
        opt.step()
    out = {k: full_tensor(p).detach().clone() for part in pipe.model_parts for k, p in part.named_parameters()}
    buffers = {k: b.detach().clone() for part in pipe.model_parts for k, b in persistent_buffers(part).items()}
    return {"losses": losses, "grads": grads, "params": out, "pipe": pipe, "norms": norms, "buffers": buffers}


def buffer_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Worst relative error of a stage's persistent buffers against the reference model's (inf for a missing or
    extra one, or a mismatched integer buffer)."""
    errs = [0.0]
    for k, b in got.items():
        if k not in want or b.shape != want[k].shape:
            return float("inf")
        same = torch.equal(b, want[k])
        errs.append(rel_err(b, want[k]) if b.is_floating_point() else (0.0 if same else float("inf")))
    return max(errs)


def compare(
    pcfg: ParallelConfig,
    args: ModelArgs = TINY,
    hf: bool = False,
    steps: int = 1,
    batch_size: int = 8,
    seq: int = 16,
    pad: bool = True,
    max_norm: float | None = None,
) -> dict:
    """Runs both builds; returns plain numbers (picklable) for the test to assert on.

    With `max_norm`, both clip before every optimizer step: torch's clip_grad_norm_ vs pp_tp's.
    """
    state = reference_state(args, hf)
    ids, labels = batch(args, batch_size, seq, pad=pad)
    ref = reference_run(state, ids, labels, args, hf, steps, max_norm=max_norm)
    got = run_pipeline(pcfg, copy.deepcopy(state), ids, labels, args, hf, steps, max_norm=max_norm)
    grad_err = max(rel_err(g, ref["grads"][k]) for k, g in got["grads"].items())
    param_err = max(rel_err(p, ref["params"][k]) for k, p in got["params"].items())
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    norm_err = max((abs(a - b) / b for a, b in zip(got["norms"], ref["norms"])), default=0.0)
    return {
        "buffer_err": buffer_err(got["buffers"], ref["buffers"]),
        "loss_err": loss_err,
        "grad_err": grad_err,
        "param_err": param_err,
        "losses": got["losses"],
        "norm_err": norm_err,
        "norms": got["norms"],
        "ref_norms": ref["norms"],
        "names": sorted(got["grads"]),
        "all_names": sorted(ref["grads"]),
        "pp_rank": got["pipe"].mesh.get_local_rank("pp"),
    }


def assert_parity(results: list[dict], tol: float = 1e-5) -> None:
    """Every rank's loss, gradients and params match; the pp ranks' parameters cover the model exactly once."""
    for r in results:
        errs = ("loss_err", "grad_err", "param_err", "norm_err", "buffer_err")
        assert all(r[e] <= tol for e in errs), r
    by_pp = {r["pp_rank"]: r["names"] for r in results}
    union = [n for names in by_pp.values() for n in names]
    assert sorted(union) == results[0]["all_names"], "pp ranks' parameters must cover the model exactly once"


def with_(pcfg: ParallelConfig, **kw) -> ParallelConfig:
    return replace(pcfg, **kw)
