"""gpu_check's real-width section (issue 47): training at the width users run, not a launch-bound toy.

    python bench/gpu_check.py --only real_width          # one H200: about 8 minutes
    python bench/gpu_check.py --cpu --only real_width    # the same code path, tiny and eager, on CPU

A Llama-3-8B-shaped model cut to 8 layers (dim 4096, ffn 14336, 32 heads over 8 KV heads, vocab 128256), seq 8192,
bf16 mixed precision (fp32 masters and gradient reduction), torch.compile on every block, AdamW, a batch of 4
sequences in 4 microbatches of one, on one GPU. Three runs of that step, one after the other, each freed before the
next:
- pp_tp: `build_pipeline` at pp = 1 with two stages on the rank (Interleaved1F1B), `Pipeline.step`;
- plain FSDP2: the same reference Transformer under `fully_shard` (each block, then the root) with the same
  MixedPrecisionPolicy, each block compiled, gradient accumulation over the same 4 microbatches (reduce on the last);
- torchtitan's llama3 (its own 8B config and model code, fused qkv, cut to 8 layers, SDPA causal attention) in the
  same FSDP2 recipe (on CPU its debug model: the code path only).
Each reports tokens/s (median of the timed steps after 2 warm-up steps) and MFU (pp_tp's `flops_per_token` over
the device's bf16 peak, `pp_tp.train.metrics`), and its peak allocated memory; pp_tp's against the planner's
per-rank peak (`pp-tp plan` on the same job). Then the attention kernel pp_tp dispatches at cp = 1: the aten SDPA
ops of one eager step of a 2-layer copy at the same width and sequence (counted with a dispatch mode).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

REAL = dict(vocab_size=128256, dim=4096, n_layers=8, n_heads=32, n_kv_heads=8, ffn_dim=14336, seq=8192, batch=4)
TINY = dict(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, seq=64, batch=4)
MICROBATCHES, WARMUP, TIMED = 4, 2, 4


def _args(shape: dict, layers: int | None = None) -> Any:
    from pp_tp.models.reference.model import ModelArgs

    keys = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")
    args = ModelArgs(**{k: shape[k] for k in keys}, max_seq_len=shape["seq"])
    return args if layers is None else ModelArgs(**{**args.__dict__, "n_layers": layers})


def _batch(shape: dict, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=gen)
    labels = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=gen)
    return ids.to(device), labels.to(device)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(step: Callable[[], None], device: str) -> tuple[float, float]:
    """(median seconds per step after the warm-up steps, peak allocated GiB on CUDA, else nan)."""
    times = []
    for i in range(WARMUP + TIMED):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return statistics.median(times), peak


def _pp_tp_step(shape: dict, device: str, compile_on: bool) -> Callable[[], None]:
    import pp_tp
    from pp_tp.models.reference.model import Transformer

    pcfg = pp_tp.ParallelConfig(
        pp=1, schedule="Interleaved1F1B", stages_per_rank=2, microbatches=MICROBATCHES, mixed_precision="bf16",
        dp_shard=1, compile=compile_on,
    )  # fmt: skip
    with torch.device("meta"):
        model = Transformer(_args(shape))
    pipe = pp_tp.build_pipeline(model, pp_tp.build_mesh(pcfg), pcfg, seq_len=shape["seq"])
    params = [p for part in pipe.model_parts for p in part.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    ids, labels = _batch(shape, "cpu")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        pipe.step(ids, labels)
        opt.step()

    return step


def _fsdp_step(model: torch.nn.Module, blocks: list, shape: dict, device: str, compile_on: bool) -> Callable:
    """`model` (logits from ids) under plain FSDP2 with pp_tp's bf16 policy, blocks compiled, gradient accumulation
    over the microbatches (the reduce-scatter on the last), AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        if compile_on:
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids, labels = _batch(shape, device)
    n = labels.numel()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(zip(ids.chunk(MICROBATCHES), labels.chunk(MICROBATCHES))):
            model.set_requires_gradient_sync(i == MICROBATCHES - 1)
            logits = model(x)
            F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum").div(n).backward()
        opt.step()

    return step


def _plain_model(shape: dict, device: str) -> tuple[torch.nn.Module, list]:
    from pp_tp.models.reference.model import Transformer

    with torch.device("meta"):
        model = Transformer(_args(shape))
    model.to_empty(device=device)
    model.init_weights(0)  # parameters from (seed, FQN), the rotary table too
    return model, list(model.layers.values())


def _titan_model(shape: dict, device: str) -> tuple[torch.nn.Module, list]:
    """torchtitan's own llama3 config (its 8B on CUDA, its debug model on CPU) cut to the shape's layer count, with
    SDPA causal attention (its flex default needs block masks its trainer builds)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import _8b, _debugmodel

    config = _8b("flex") if device == "cuda" else _debugmodel("flex")
    config.layers = config.layers[: shape["n_layers"]]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    return model, list(model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers)


def attention_kernels(shape: dict) -> Counter:
    """The aten SDPA ops of one eager Pipeline.step of a 2-layer copy at cp = 1 (the kernel pp_tp runs)."""
    import pp_tp
    from pp_tp.base._torch import TorchDispatchMode
    from pp_tp.models.reference.model import Transformer

    class Kernels(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: Counter = Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            name = func.overloadpacket.__name__
            if "attention" in name or "scaled_dot_product" in name:
                self.seen[name] += 1
            return func(*args, **(kwargs or {}))

    pcfg = pp_tp.ParallelConfig(pp=1, schedule="GPipe", microbatches=1, mixed_precision="bf16", dp_shard=1)
    with torch.device("meta"):
        model = Transformer(_args(shape, layers=2))
    pipe = pp_tp.build_pipeline(model, pp_tp.build_mesh(pcfg), pcfg, seq_len=shape["seq"])
    ids, labels = _batch({**shape, "batch": 1}, "cpu")
    with Kernels() as k:
        pipe.step(ids, labels)
    return k.seen


def run(device: str, say: Callable[[str, str], None], plan_peak: Callable[[dict], float | None]) -> None:
    """The section: every variant in turn, then the kernel; `plan_peak(shape)` is the planner's GiB for the job."""
    from pp_tp.layout import layout_for
    from pp_tp.models.reference.model import Transformer
    from pp_tp.train.metrics import flops_per_token, peak_flops

    shape = REAL if device == "cuda" else TINY
    compile_on = device == "cuda"  # inductor on CPU needs a compiler toolchain: the CPU run checks the code path
    with torch.device("meta"):
        meta = Transformer(_args(shape))
    per_token = flops_per_token(meta, layout_for(meta), shape["seq"])
    peak = peak_flops(torch.cuda.get_device_name()) if device == "cuda" else None
    tokens = shape["batch"] * shape["seq"]
    say("real_width", f"shape {shape}, {MICROBATCHES} microbatches, compile {compile_on}, {per_token:.3e} FLOP/token")
    builds = {
        "pp_tp": lambda: _pp_tp_step(shape, device, compile_on),
        "plain FSDP2": lambda: _fsdp_step(*_plain_model(shape, device), shape, device, compile_on),
        "torchtitan llama3": lambda: _fsdp_step(*_titan_model(shape, device), shape, device, compile_on),
    }
    rates = {}
    for name, build in builds.items():
        try:
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            seconds, mem = _measure(build(), device)
        except Exception as e:  # noqa: BLE001  (one variant's failure is a finding; the others still run)
            say("real_width", f"{name}: FAIL {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        rates[name] = tokens / seconds
        mfu = f"MFU {per_token * rates[name] / peak:.3f}" if peak else "MFU n/a (no bf16 peak known here)"
        say("real_width", f"{name}: {rates[name]:,.0f} tokens/s, {mfu}, peak allocated {mem:.2f} GiB")
        if name == "pp_tp":
            planned = plan_peak(shape)
            ratio = f" (planned/measured {planned / mem:.3f})" if planned and mem == mem else ""
            say("real_width", f"pp_tp peak memory: measured {mem:.2f} GiB, planner {planned} GiB{ratio}")
    if "pp_tp" in rates:
        others = ", ".join(f"{k} {rates['pp_tp'] / v:.3f}" for k, v in rates.items() if k != "pp_tp")
        say("real_width", f"pp_tp tokens/s over: {others or 'no other variant ran'}")
    say("real_width", f"attention ops at cp = 1 (eager, 2 layers): {dict(attention_kernels(shape))}")
