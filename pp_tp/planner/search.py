"""`pp-tp plan --search`: enumerate layouts of a job at a world size, keep those whose predicted per-rank
peak fits, rank them by a simulated step time.

Cost model (stated, not measured): a stage's compute is its analytic FLOPs (pp_tp.split.cost: 6 x matmul
params + attention per token, fwd+bwd; full AC adds one forward, 1/3 of it) over tp at the device's peak
FLOP/s; TP adds 4 ring all-reduces of [mb, seq, dim] bf16 per block per microbatch at NVLink bandwidth;
FSDP moves the step walk's all-gather and reduce-scatter bytes ((n-1)/n of them) at NVLink bandwidth when
tp x dp_shard (x cp) fits a node of 8, else InfiniBand, overlapped with compute (only what exceeds compute
shows); expert parallel moves pp_tp.planner.moe.all_to_all_bytes per MoE layer and microbatch (balanced
routing) at NVLink bandwidth when the ep x tp group fits a node of 8, else InfiniBand, not overlapped (the
next layer waits for its tokens). Step time = max over pp ranks of (compute + TP + EP) x (1 + simulated
bubble) + exposed FSDP time. Context parallel divides a rank's compute and TP traffic by cp (each rank runs seq / cp
tokens, head-tail balanced) and moves pp_tp.planner.context.rank_kv_bytes (the K/V all-gather forward, the
reduce-scatter of their gradients backward) at NVLink bandwidth when the cp x tp group fits a node of 8, else
InfiniBand, not overlapped (attention waits for the keys); FSDP then spans dp_shard x cp ranks.

Searched: tp 1/2/4/8, pp 1 to 32, cp 1 to 32 (2 x cp dividing seq_len; what the config rules refuse under cp is
skipped like any invalid layout), dp_replicate 1 or dp/8, ep every divisor of dp_shard that
splits the experts evenly (MoE models), GPipe, 1F1B, Interleaved1F1B (2 or 4 stages per
rank), InterleavedZeroBubble, ZBVZeroBubble, microbatches pp/2pp/4pp, AC none/selective/full, and per pp
rank the (reshard, grad-reduce) pairs "auto" picks from. Each layout is evaluated from shared caches
(pp_tp.planner.layout_eval), equal to a full dry run, so 1024 ranks of a 405B model take seconds.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from pp_tp.config import JobConfig
from pp_tp.errors import ConfigError
from pp_tp.layout import ModelDims, layout_for
from pp_tp.models.factory import build_model
from pp_tp.planner.auto import GIB, comm_bytes
from pp_tp.planner.context import rank_kv_bytes
from pp_tp.planner.layout_eval import LayoutEvaluator, LayoutPlan, Outline
from pp_tp.planner.moe import Experts, model_experts, rank_all_to_all_bytes

DEVICES = {"H100": (989e12, 450e9, 50e9), "H200": (989e12, 450e9, 50e9)}  # bf16 dense FLOP/s, NVLink, IB B/s
NODE = 8
TPS, PPS, CPS = (1, 2, 4, 8), (1, 2, 4, 8, 16, 32), (1, 2, 4, 8, 16, 32)
PARALLEL_KEYS = ("pp", "tp", "ep", "cp", "dp_replicate", "dp_shard", "schedule", "stages_per_rank", "microbatches")
POLICY_KEYS = ("fsdp_reshard_after_forward", "fsdp_grad_reduce", "activation_checkpoint")


@dataclass(frozen=True)
class Device:
    peak_flops: float
    nvlink_bw: float
    ib_bw: float


@dataclass
class Candidate:
    parallel: dict
    peak_gib: float
    step_time_s: float
    bubble: float


def _busy(cfg: JobConfig, o: Outline, dev: Device, dims: ModelDims, experts: Experts | None) -> list[tuple]:
    """Per pp rank (seconds of compute + TP + EP + CP traffic, of which compute): what the step time needs beyond
    FSDP, from the outline alone (the cost model in the module docstring)."""
    p, t = o.pcfg, cfg.training
    d = dims.dim
    tokens = o.microbatch * t.seq_len
    recompute = {"full": 4 / 3, "selective": 1.1}.get(p.activation_checkpoint, 1.0)
    out = []
    for r in range(p.pp):
        stages = o.plan.for_rank(r)
        local = tokens / p.cp  # each cp rank runs its head-tail share of every sequence
        compute = sum(s.cost for s in stages) * local * p.microbatches * recompute / p.tp / dev.peak_flops
        blocks = sum(len(s.blocks) for s in stages)
        ar = 2 * (p.tp - 1) / p.tp * local * d * 2 / dev.nvlink_bw if p.tp > 1 else 0.0
        tp_time = 4 * blocks * p.microbatches * ar
        kv = rank_kv_bytes(blocks, p, o.microbatch, t.seq_len, dims)
        cp_time = kv / (dev.nvlink_bw if p.cp * p.tp <= NODE else dev.ib_bw)
        ep_time = 0.0
        if experts is not None and p.ep > 1:  # the ep group is ep x tp neighbouring ranks (pp_tp.parallel.mesh)
            sent = rank_all_to_all_bytes(experts, (b for s in stages for b in s.blocks), p, tokens, d)
            ep_time = sent / (dev.nvlink_bw if p.ep * p.tp <= NODE else dev.ib_bw)
        out.append((compute + tp_time + ep_time + cp_time, compute))
    return out


def time_floor(cfg: JobConfig, o: Outline, dev: Device, dims: ModelDims, experts: Experts | None = None) -> float:
    """A lower bound of the outlined layout's step_time, whatever its FSDP policies and memory: step_time adds the
    exposed FSDP time, max(0, ...), to each rank's term (IEEE rounding is monotone, so the bound holds exactly)."""
    return max(busy * (1 + o.bubble) for busy, _ in _busy(cfg, o, dev, dims, experts))


def step_time(cfg: JobConfig, lay: LayoutPlan, dev: Device, dims: ModelDims, experts: Experts | None = None) -> float:
    """Seconds per step of the evaluated layout under the cost model in the module docstring."""
    p = lay.pcfg
    o = Outline(p, lay.plan, [], lay.bubble, lay.microbatch)
    worst = 0.0
    for (busy, compute), r, walk in zip(_busy(cfg, o, dev, dims, experts), lay.ranks, lay.walks):
        shard = p.dp_shard * p.cp  # FSDP's group
        bw = dev.nvlink_bw if p.tp * shard <= NODE else dev.ib_bw
        fsdp = comm_bytes(r, walk) * (shard - 1) / max(shard, 1) / bw
        worst = max(worst, busy * (1 + lay.bubble) + max(0.0, fsdp - compute))
    return worst


def _schedules(pp: int, layers: int) -> list[tuple[str, int]]:
    """(schedule, stages per rank) pairs the search tries at `pp`."""
    if pp == 1:
        return [("1F1B", 1)]
    pairs = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("Interleaved1F1B", 4)]
    pairs += [("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)]
    return [(s, v) for s, v in pairs if pp * v <= layers]


def _eps(dp_shard: int, experts: Experts | None) -> list[int]:
    """Expert-parallel degrees tried: divisors of dp_shard that split the experts evenly (1 for a dense model)."""
    if experts is None:
        return [1]
    return [e for e in range(1, dp_shard + 1) if dp_shard % e == 0 and experts.n_experts % e == 0]


def _cps(cfg: JobConfig) -> list[int]:
    """Context-parallel degrees tried: those whose 2 x cp divides seq_len (the config rules refuse the rest)."""
    return [cp for cp in CPS if cp == 1 or cfg.training.seq_len % (2 * cp) == 0]


def _layouts(cfg: JobConfig, world: int, experts: Experts | None = None):
    """Every layout the search evaluates: degrees, schedule, stages per rank, microbatches, AC."""
    heads, kv = cfg.model.n_heads, cfg.model.n_kv_heads or cfg.model.n_heads
    for tp, pp, cp in itertools.product(TPS, PPS, _cps(cfg)):
        if world % (tp * pp * cp) or heads % tp or kv % tp or pp > cfg.model.n_layers:
            continue
        dp = world // (tp * pp * cp)
        for rep in sorted({1, dp // NODE} - {0}) if dp > NODE else (1,):
            for (sched, spr), m in itertools.product(_schedules(pp, cfg.model.n_layers), sorted({pp, 2 * pp, 4 * pp})):
                if cfg.training.batch_size % (dp * m) == 0:
                    for ep, ac in itertools.product(_eps(dp // rep, experts), ("none", "selective", "full")):
                        yield dict(
                            pp=pp, tp=tp, ep=ep, cp=cp, dp_replicate=rep, dp_shard=dp // rep, schedule=sched,
                            stages_per_rank=spr, microbatches=m, activation_checkpoint=ac,
                        )  # fmt: skip


@contextlib.contextmanager
def _fewer_collections() -> Iterator[None]:
    """Inside: Python's cyclic collector leaves the objects that exist on entry alone (torch, the model) and runs its
    youngest generation every 50,000 allocations instead of 700. The search allocates millions of short-lived
    objects (fake tensors, walks, configs), and each collection of the default schedule walked that large heap:
    about a tenth of the 405B search's CPU time (BENCHMARKS.md, "Planner search time at 1024 ranks")."""
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(50_000, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def search(cfg: JobConfig, world: int, budget_gib: float, dev: Device, top: int) -> list[Candidate]:
    """The `top` fitting layouts, fastest first (ties in enumeration order); FSDP policies are "auto" under the
    budget for each.

    Branch and bound: layouts are outlined (validated, planned; nothing measured) and visited in order of
    time_floor; once `top` fitting layouts are found, a layout whose floor exceeds the slowest of them cannot
    enter the list, nor can any after it, so the search stops there. The answer is the exhaustive search's."""
    with _fewer_collections():
        return _search(cfg, world, budget_gib, dev, top)


def _search(cfg: JobConfig, world: int, budget_gib: float, dev: Device, top: int) -> list[Candidate]:
    model = build_model(cfg.model, "meta")
    layout = layout_for(model)
    evaluator = LayoutEvaluator(cfg, world, model, layout)
    experts = model_experts(model, layout)
    dims = evaluator.costs.dims
    outlines = []
    last: tuple[dict, Outline | None] = ({}, None)  # the previous layout but its AC, and its outline
    for i, kw in enumerate(_layouts(cfg, world, experts)):
        ac = kw.pop("activation_checkpoint")
        if kw != last[0]:  # the config rules do not depend on the AC mode (tests/test_planner_search.py)
            pcfg = dataclasses.replace(
                cfg.parallel, **kw, fsdp_reshard_after_forward="auto", fsdp_grad_reduce="auto",
                memory_budget_gib=budget_gib, split="balanced", layers_per_stage=None, stage_fqns=None,
                compile=False, float8=False, activation_checkpoint=ac,
            )  # fmt: skip
            try:
                last = (kw, evaluator.outline(pcfg))
            except ConfigError:
                last = (kw, None)  # not a valid layout for this model and batch
        if last[1] is not None:
            o = dataclasses.replace(last[1], pcfg=dataclasses.replace(last[1].pcfg, activation_checkpoint=ac))
            outlines.append((time_floor(cfg, o, dev, dims, experts), i, o))
    found: list[tuple[float, int, Candidate]] = []
    for floor, i, o in sorted(outlines, key=lambda x: x[:2]):
        if top <= len(found) and floor > found[top - 1][0]:
            break
        try:
            lay = evaluator.fit(o)
        except ConfigError:
            continue  # refused once its stages are built
        if lay is not None:
            keys = {k: getattr(lay.pcfg, k) for k in PARALLEL_KEYS + POLICY_KEYS}
            time_s = step_time(cfg, lay, dev, dims, experts)
            bisect.insort(found, (time_s, i, Candidate(keys, lay.peak_bytes / GIB, time_s, lay.bubble)))
    return [c for _, _, c in found[:top]]


__all__ = ["DEVICES", "Candidate", "Device", "search", "step_time", "time_floor"]
