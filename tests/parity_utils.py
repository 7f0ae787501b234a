"""Shared pieces of the multi-rank parity tests: the same weights and batch everywhere, the non-PP
reference computed on every rank, and comparisons of loss, full gradients, updated parameters and buffers
(the runs and comparisons are pp_tp/parity/lockstep.py's, which `pp-tp parity` runs too)."""

from __future__ import annotations

import copy
from dataclasses import asdict, replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import pp_tp
from pp_tp.base.per_world import once_per_world
from pp_tp.base.tensors import full_tensor, persistent_buffers  # noqa: F401  (tests reach pu.full_tensor)
from pp_tp.config import ModelConfig, ParallelConfig
from pp_tp.models.factory import build_model
from pp_tp.models.reference.model import ModelArgs
from pp_tp.parity import PipelineRun, ReferenceRun, StepDiff, lockstep, rel_err  # noqa: F401  (tests reach pu.rel_err)

TINY = ModelArgs(vocab_size=96, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=32)


def flat_mesh(n: int) -> DeviceMesh:
    """A 1-D mesh over the first n ranks of the world, made once per world like pp_tp's own meshes."""
    return once_per_world(("tests: flat mesh", n), lambda: init_device_mesh("cpu", (n,)))


def pcfg_of(**kw) -> ParallelConfig:
    kw.setdefault("mixed_precision", "fp32")
    kw.setdefault("dp_shard", 1)
    return ParallelConfig(**kw)


def make_hf_llama(args: ModelArgs, device: str = "cpu") -> nn.Module:
    return make_model(args, hf=True, device=device)


def make_model(args: ModelArgs = TINY, hf: bool = False, device: str = "cpu") -> nn.Module:
    return build_model(ModelConfig(**asdict(args), kind="hf_llama" if hf else "reference"), device)


def reference_state(args: ModelArgs = TINY, hf: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random full weights by FQN, with non-trivial norms and biases so every path is exercised; persistent
    buffers (the reference MoE's router biases) random too, so one left unfilled or unused shows."""
    gen = torch.Generator().manual_seed(seed)
    model = make_model(args, hf)
    state = seeded({k: v.shape for k, v in model.named_parameters()}, gen, 0.05, bias=0.1)  # a tied weight once
    state.update({k: torch.randn(b.shape, generator=gen) * 0.05 for k, b in persistent_buffers(model).items()})
    return state


def seeded(
    shapes: dict[str, torch.Size],
    seed: int | torch.Generator = 0,
    scale: float = 0.1,
    bias: float | None = None,
    norm: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Seeded random values by name, drawn in order: N(0, scale) (N(0, bias) for names ending in "bias" when given),
    plus `norm` for norm weights (near 1, so every path is exercised). Same seed and shapes: the same values on every
    rank. `seed` may be a generator to draw on from."""
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    out = {}
    for k, shape in shapes.items():
        std = bias if bias is not None and k.endswith("bias") else scale
        out[k] = torch.randn(shape, generator=gen) * std + (norm if "norm" in k and k.endswith("weight") else 0.0)
    return out


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


def adamw(lr: float = 1e-3):
    """The tests' optimizer factory for ReferenceRun and PipelineRun: torch's AdamW defaults (eps 1e-8, whose first
    step turns roundoff on near-zero gradients into whole updates: the float64 verdict judges that fairly), fused,
    one parameter per group. DTensor caches an op's sharding by the specs of all its tensors: one group's fused op
    over a case's whole parameter list is new in every case and its propagation cost ~0.3 s of CPU per rank on the
    2-D meshes of FSDP x TP (cProfile of rank 0: 65 misses, 19 s, over six parity files), while one parameter's shape
    and placements recur across cases. Elementwise per parameter, so the values are those of any grouping."""

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW([{"params": [p]} for p in params], lr=lr, weight_decay=0.1, fused=True)

    return make


def reference(
    state: dict, args: ModelArgs = TINY, hf: bool = False, lr: float = 1e-3, max_norm: float | None = None
) -> ReferenceRun:
    """The single-process, non-PP build on `state`."""
    torch.manual_seed(0)
    model = make_model(args, hf)
    model.load_state_dict(state, strict=False)
    return ReferenceRun(model, adamw(lr), max_norm)


def pipeline(
    pcfg: ParallelConfig,
    state: dict,
    args: ModelArgs = TINY,
    hf: bool = False,
    lr: float = 1e-3,
    max_norm: float | None = None,
) -> PipelineRun:
    """The pipelined build on the same weights."""
    pipe = pp_tp.build_pipeline(make_model(args, hf, device="meta"), pp_tp.build_mesh(pcfg), pcfg, state_dict=state)
    return PipelineRun(pipe, adamw(lr), max_norm)


def _record(side: ReferenceRun | PipelineRun, ids: torch.Tensor, labels: torch.Tensor, steps: int) -> dict:
    """`steps` steps on one batch: losses, the first step's gradients, params after the steps, norms, buffers."""
    grads = None
    for _ in range(steps):
        side.step(ids, labels)
        grads = grads or {k: g.detach().clone() for k, g in side.grads().items()}
    params = {k: p.clone() for k, p in side.params().items()}
    buffers = {k: b.detach().clone() for k, b in side.buffers().items()}
    return {"losses": side.losses, "grads": grads, "params": params, "norms": side.norms, "buffers": buffers}


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
    """The single-process, non-PP build: loss, gradients and params after `steps` optimizer steps."""
    return _record(reference(state, args, hf, lr, max_norm), ids, labels, steps)


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
    run = pipeline(pcfg, state, args, hf, lr, max_norm)
    return {**_record(run, ids, labels, steps), "pipe": run.pipe}


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
    """Both builds in lockstep (pp_tp.parity); returns plain numbers (picklable) for the test to assert on.

    With `max_norm`, both clip before every optimizer step: torch's clip_grad_norm_ vs pp_tp's.
    """
    state = reference_state(args, hf)
    ids, labels = batch(args, batch_size, seq, pad=pad)
    ref = reference(state, args, hf, max_norm=max_norm)
    run = pipeline(pcfg, copy.deepcopy(state), args, hf, max_norm=max_norm)
    return {
        **summary(list(lockstep(run, ref, [(ids, labels)] * steps))),
        "losses": run.losses,
        "norm_err": max((abs(a - b) / b for a, b in zip(run.norms, ref.norms)), default=0.0),
        "norms": run.norms,
        "ref_norms": ref.norms,
        "names": sorted(run.keys),
        "all_names": sorted(ref.grads()),
        "pp_rank": run.pipe.mesh.get_local_rank("pp"),
    }


def summary(diffs: list[StepDiff]) -> dict:
    """The steps' worst errors against the plain build (`loss_err`, ...: for information and for tests that show a
    build is off) and the float64 verdict: `score` (passes at <= 1) and each kind's worst score (`scores`)."""
    kinds = diffs[0].judged
    return {
        **{e: max(getattr(d, e) for d in diffs) for e in ("loss_err", "grad_err", "param_err", "buffer_err")},
        "score": max(d.score for d in diffs),
        "scores": {k: max(d.judged[k].score for d in diffs) for k in kinds},
    }


def assert_passes(r: dict, *context) -> None:
    """One rank's result passes the float64 verdict (pp_tp/parity/lockstep.py)."""
    assert r["score"] <= 1.0, (*context, r["scores"], r)


def assert_parity(results: list[dict]) -> None:
    """Every rank's loss, gradients, params, buffers and norms pass the float64 verdict; the pp ranks' parameters
    cover the model exactly once."""
    for r in results:
        assert_passes(r)
    by_pp = {r["pp_rank"]: r["names"] for r in results}
    union = [n for names in by_pp.values() for n in names]
    assert sorted(union) == results[0]["all_names"], "pp ranks' parameters must cover the model exactly once"


def with_(pcfg: ParallelConfig, **kw) -> ParallelConfig:
    return replace(pcfg, **kw)
