"""One-GPU check: what only a CUDA device can show, in one prepared run of a few minutes.

    python bench/gpu_check.py            # on a machine with one CUDA GPU; prints one line per finding
    python bench/gpu_check.py --cpu      # the same sections, tiny, on CPU: checks the script itself

Where no CUDA device is present (and no --cpu) it prints one skip line and exits 0. Each section runs alone: a
failure prints `FAIL <section>: <error>` and the next section still runs, so one lease gives every answer.
Sections:
- trainer: pp_tp's real trainer (`pp-tp train`'s loop) on one rank over NCCL, bf16 mixed precision, two pipeline
  stages on the rank (Interleaved1F1B), AdamW; losses, tokens/s, and torch.cuda.max_memory_allocated against the
  planner's per-rank peak (`pp-tp plan --json` on the same TOML).
- stages_vs_plain: forward+backward tokens/s of the pipeline's stage modules (Pipeline.step) against the plain model
  under bf16 autocast, same weights and batch, and their losses.
- sdpa: SDPA's fused kernels (flash, efficient, cudnn) forced one at a time, causal bf16, forward+backward: error
  against the math kernel and time.
- float8: torchao's Float8Linear (pp_tp.parallel.float8's conversion) against bf16 Linear layers: error and the
  speed ratio of a large MLP; then the trainer with parallel.float8 = true, its losses against bf16's.
- grouped_mm: the reference MoE's experts through F.grouped_mm against the per-expert loop (pp_tp takes grouped_mm
  on CPU and CUDA where it fits): bit equality, error, speed ratio.
- real_width: a Llama-3-8B-wide model, 8 layers, seq 8192, compiled: pp_tp against plain FSDP2 and torchtitan's
  llama3, tokens/s, MFU, peak memory against the planner, the attention kernel at cp = 1 (bench/gpu_realwidth.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import gpu_realwidth
import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

BIG = dict(vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, ffn_dim=2816, seq=1024, batch=8, steps=12)
TINY = dict(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, seq=64, batch=8, steps=3)


def say(section: str, text: str) -> None:
    print(f"gpu_check {section}: {text}", flush=True)


def timed(fn: Callable[[], object], device: str, reps: int) -> float:
    """Mean seconds per call after one warm-up call."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / reps


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


def job_toml(size: dict, folder: str, float8: bool = False) -> str:
    """The check's job: the reference model, one rank, two stages, bf16, synthetic tokens, no checkpoints."""
    path = os.path.join(folder, f"job{'_fp8' if float8 else ''}.toml")
    with open(path, "w") as f:
        f.write(
            f"""[model]
vocab_size = {size["vocab_size"]}
dim = {size["dim"]}
n_layers = {size["n_layers"]}
n_heads = {size["n_heads"]}
n_kv_heads = {size["n_kv_heads"]}
ffn_dim = {size["ffn_dim"]}
max_seq_len = {size["seq"]}
[parallel]
pp = 1
schedule = "Interleaved1F1B"
stages_per_rank = 2
microbatches = 4
mixed_precision = "bf16"
float8 = {"true" if float8 else "false"}
[training]
batch_size = {size["batch"]}
seq_len = {size["seq"]}
steps = {size["steps"]}
warmup_steps = 2
lr = 3e-4
log_every = 4
[checkpoint]
interval = 0
folder = "{folder}/ckpt"
"""
        )
    return path


def section_env(device: str, size: dict, folder: str) -> None:
    say("env", f"torch {torch.__version__}, cuda {torch.version.cuda}, device {device}")
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        mem = p.total_memory / 2**30
        say("env", f"{p.name}, capability {p.major}.{p.minor}, {mem:.1f} GiB, {p.multi_processor_count} SMs")
    import pp_tp

    say("env", f"pp_tp imported from {os.path.dirname(pp_tp.__file__)}")


def _train(path: str) -> list[dict]:
    from pp_tp.config import load_config
    from pp_tp.train.trainer import train

    return train(load_config(path, []))


def section_trainer(device: str, size: dict, folder: str) -> None:
    path = job_toml(size, folder)
    plan = subprocess.run(
        [sys.executable, "-m", "pp_tp.cli", "plan", "--config", path, "--world-size", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    peak = json.loads(plan.stdout.strip().splitlines()[-1])["peak_gib"] if plan.returncode == 0 else None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rows = _train(path)
    losses = [round(r["loss"], 4) for r in rows]
    tps = sorted(r["tokens_per_s"] for r in rows[2:]) or [rows[-1]["tokens_per_s"]]
    say("trainer", f"losses {losses}")
    say("trainer", f"tokens/s median {tps[len(tps) // 2]:,.0f} (steps after 2 warm-up)")
    measured = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    planned = f"{peak:.3f} GiB" if peak is not None else f"planner failed: {plan.stderr.strip()[-300:]}"
    ratio = f"planned/measured {peak / measured:.3f}" if peak and measured == measured else ""
    say("trainer", f"peak memory: measured {measured:.3f} GiB, planner {planned} {ratio}")
    assert losses[-1] < losses[0], f"loss did not fall: {losses}"


def _models(size: dict, device: str) -> tuple[torch.nn.Module, dict[str, object]]:
    """The plain reference model (fp32 weights, seeded) and pipelines on this rank from the same weights, bf16 mixed
    precision: two stages x 4 microbatches (the trainer's layout) and one stage x 1 microbatch (the machinery alone)."""
    import pp_tp
    from pp_tp.models.reference.model import ModelArgs, Transformer

    args = ModelArgs(
        **{k: size[k] for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")},
        max_seq_len=size["seq"],
    )
    torch.manual_seed(0)
    plain = Transformer(args)
    plain.init_weights(0)
    state = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    pipes = {}
    for name, schedule, spr, m in (("2 stages x 4 mb", "Interleaved1F1B", 2, 4), ("1 stage x 1 mb", "GPipe", 1, 1)):
        pcfg = pp_tp.ParallelConfig(
            pp=1, schedule=schedule, stages_per_rank=spr, microbatches=m, mixed_precision="bf16", dp_shard=1
        )
        with torch.device("meta"):
            meta = Transformer(args)
        pipes[name] = pp_tp.build_pipeline(meta, pp_tp.build_mesh(pcfg), pcfg, state_dict=state)
    return plain.to(device), pipes


def section_stages_vs_plain(device: str, size: dict, folder: str) -> None:
    plain, pipes = _models(size, device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size["vocab_size"], (size["batch"], size["seq"]), generator=gen)
    labels = torch.randint(0, size["vocab_size"], (size["batch"], size["seq"]), generator=gen)
    ids_d, labels_d = ids.to(device), labels.to(device)

    def plain_step(chunks: int) -> float:
        """Forward+backward of the whole batch in `chunks` accumulated pieces (the microbatches' granularity)."""
        plain.zero_grad(set_to_none=True)
        total = 0.0
        for piece, target in zip(ids_d.chunk(chunks), labels_d.chunk(chunks)):
            with torch.autocast(device, dtype=torch.bfloat16):
                logits = plain(piece)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten()) / chunks
            loss.backward()
            total += float(loss.detach())
        return total

    def pipe_step(pipe) -> float:
        for part in pipe.model_parts:
            part.zero_grad(set_to_none=True)
        return float(pipe.step(ids, labels))

    reps = 5 if device == "cuda" else 1
    tokens = ids.numel()
    t_plain = {c: timed(lambda c=c: plain_step(c), device, reps) for c in (1, 4)}
    rates = [f"plain {tokens / t_plain[1]:,.0f}", f"plain in 4 accumulated pieces {tokens / t_plain[4]:,.0f}"]
    losses = [f"plain (autocast bf16) {plain_step(1):.5f}"]
    for name, pipe in pipes.items():
        t = timed(lambda p=pipe: pipe_step(p), device, reps)
        rates.append(f"pipeline {name} {tokens / t:,.0f} ({t_plain[1] / t:.3f} of plain)")
        losses.append(f"pipeline {name} {pipe_step(pipe):.5f}")
    say("stages_vs_plain", f"loss {', '.join(losses)}")
    say("stages_vs_plain", f"tokens/s {'; '.join(rates)}")


def section_sdpa(device: str, size: dict, folder: str) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, s, d = (size["batch"], size["n_heads"], size["seq"], size["dim"] // size["n_heads"])
    gen = torch.Generator(device=device).manual_seed(2)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(3))

    def run(backend: SDPBackend) -> tuple[torch.Tensor, torch.Tensor]:
        qq = q.detach().requires_grad_()
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(qq, k, v, is_causal=True)
        out.float().square().sum().backward()
        return out.detach(), qq.grad

    want, want_g = run(SDPBackend.MATH)
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        backend = getattr(SDPBackend, name)
        try:
            out, g = run(backend)
            t = timed(lambda b=backend: run(b), device, 10 if device == "cuda" else 1)
            errs = f"out err {rel(out, want):.2e}, dq err {rel(g, want_g):.2e}"
            say("sdpa", f"{name}: ok, {errs}, fwd+bwd {1e3 * t:.3f} ms")
        except Exception as e:  # noqa: BLE001  (a kernel this device or build lacks is a finding, not a stop)
            say("sdpa", f"{name}: not available: {str(e).splitlines()[0][:200]}")


def section_float8(device: str, size: dict, folder: str) -> None:
    import importlib.util

    from torch import nn

    if importlib.util.find_spec("torchao") is None:
        say("float8", "skipped: torchao is not installed (pip install torchao)")
        return
    from pp_tp.config import ParallelConfig
    from pp_tp.parallel.float8 import check_float8

    check_float8(ParallelConfig(float8=True, mixed_precision="bf16"), device)
    from torchao.float8 import convert_to_float8_training

    dim = 4096 if device == "cuda" else 64
    torch.manual_seed(3)
    mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.GELU(), nn.Linear(4 * dim, dim, bias=False))
    mlp = mlp.to(device, torch.bfloat16)
    fp8 = convert_to_float8_training(__import__("copy").deepcopy(mlp))
    x = torch.randn(8192 if device == "cuda" else 64, dim, device=device, dtype=torch.bfloat16)

    def step(m: nn.Module) -> torch.Tensor:
        m.zero_grad(set_to_none=True)
        out = m(x)
        out.float().square().mean().backward()
        return out.detach()

    out16, out8 = step(mlp), step(fp8)
    g16, g8 = mlp[0].weight.grad, fp8[0].weight.grad
    reps = 10 if device == "cuda" else 1
    t16, t8 = timed(lambda: step(mlp), device, reps), timed(lambda: step(fp8), device, reps)
    errs = f"out err {rel(out8, out16):.2e}, w1 grad err {rel(g8, g16):.2e}"
    say("float8", f"MLP {dim}x{4 * dim}: {errs}, fwd+bwd bf16/float8 time {t16 / t8:.3f} (eager)")
    if device == "cuda":  # torchao's fast path is compiled (its casts fuse into the matmuls' neighbours)
        c16, c8 = torch.compile(mlp), torch.compile(fp8)
        t16, t8 = timed(lambda: step(c16), device, reps), timed(lambda: step(c8), device, reps)
        say("float8", f"MLP under torch.compile: fwd+bwd bf16/float8 time {t16 / t8:.3f}")
    rows = _train(job_toml(size, folder, float8=True))
    say("float8", f"trainer with parallel.float8: losses {[round(r['loss'], 4) for r in rows]}")


def section_grouped_mm(device: str, size: dict, folder: str) -> None:
    from pp_tp.models.reference.moe import Experts

    n, dim, ffn, tokens = (64, 2048, 1024, 16384) if device == "cuda" else (4, 64, 32, 256)
    torch.manual_seed(4)
    counts = torch.distributions.Multinomial(tokens, torch.ones(n)).sample().long().tolist()
    for dtype in (torch.bfloat16, torch.float32):
        experts = Experts(n, dim, ffn).to(device, dtype)
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.02)
        x = torch.randn(tokens, dim, device=device, dtype=dtype)
        up = torch.randn(tokens, dim, device=device, dtype=dtype)

        def run(fn: Callable, e: Experts = experts, x: torch.Tensor = x, up: torch.Tensor = up) -> list[torch.Tensor]:
            """Output, input gradient and both weight gradients."""
            e.zero_grad(set_to_none=True)
            xx = x.detach().requires_grad_()
            out = fn(xx, counts)
            out.backward(up)
            return [out.detach(), xx.grad, e.gate_up_proj.grad, e.down_proj.grad]

        ends = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)  # the groups' ends, as forward has them

        def grouped_fn(
            xx: torch.Tensor, _counts: list, e: Experts = experts, ends: torch.Tensor = ends
        ) -> torch.Tensor:
            return e._grouped(xx, ends)

        loop, grouped = run(experts._loop), run(grouped_fn)
        reps = 10 if device == "cuda" else 1
        t_loop, t_grouped = (
            timed(lambda e=experts: run(e._loop, e), device, reps),
            timed(lambda e=experts, g=grouped_fn: run(g, e), device, reps),
        )
        same = [torch.equal(a, b) for a, b in zip(loop, grouped)]
        errs = ", ".join(f"{rel(b, a):.1e}" for a, b in zip(loop, grouped))
        say(
            "grouped_mm",
            f"{dtype}, {n} experts, {tokens} rows, fwd+bwd: bit-equal (out, dx, dgate_up, ddown) {same}, "
            f"errors {errs}, loop/grouped time {t_loop / t_grouped:.3f}",
        )


def _plan_peak(shape: dict, folder: str) -> float | None:
    """The planner's per-rank peak (GiB) for the check's job at `shape` (`pp-tp plan --json`), None if it fails."""
    size = {**shape, "steps": 1}
    plan = subprocess.run(
        [sys.executable, "-m", "pp_tp.cli", "plan", "--config", job_toml(size, folder), "--world-size", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    return json.loads(plan.stdout.strip().splitlines()[-1])["peak_gib"] if plan.returncode == 0 else None


def section_real_width(device: str, size: dict, folder: str) -> None:
    gpu_realwidth.run(device, say, lambda shape: _plan_peak(shape, folder))


SECTIONS = [
    section_env,
    section_trainer,
    section_stages_vs_plain,
    section_sdpa,
    section_float8,
    section_grouped_mm,
    section_real_width,
]


def init_single_rank(device: str) -> None:
    """A one-rank default process group (NCCL on CUDA), as torchrun would give."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    from pp_tp.parallel.mesh import init_distributed

    init_distributed(300.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run the sections tiny on CPU (checks the script)")
    parser.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: skip: no CUDA device here (torch.cuda.is_available() is False)")
        return 0
    device = "cpu" if args.cpu else "cuda"
    if args.cpu:
        torch.cuda.is_available = lambda: False  # pp_tp's device choice follows torch.cuda
    size = TINY if args.cpu else BIG
    init_single_rank(device)
    failed = []
    with tempfile.TemporaryDirectory() as folder:
        for section in SECTIONS:
            name = section.__name__.removeprefix("section_")
            if args.only and name not in args.only.split(","):
                continue
            t0 = time.perf_counter()
            try:
                section(device, size, folder)
                say(name, f"done in {time.perf_counter() - t0:.1f} s")
            except Exception as e:  # noqa: BLE001  (each section reports and the next runs)
                failed.append(name)
                print(f"FAIL {name}: {type(e).__name__}: {str(e)[:500]}", flush=True)
                traceback.print_exc(limit=4)
    print(f"gpu_check: sections failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
