"""`pp-tp plan`: a dry run of a job in one process, at any world size, with no memory and no peers.

torch's `fake` process-group backend stands in for the world (collectives return at once), so the
real mesh, stage plan and parallelization passes (TP, AC, FSDP) run unchanged on the meta device. Per
pp rank, at dp/tp coordinate 0 (the largest FSDP shard), it reports:

- parameter, gradient and AdamW bytes read off the sharded parameters themselves (DTensor local
  shapes, FSDP padding included); FSDP keeps fp32 shards, all-gathers a compute copy in the param
  dtype, and under pipelining keeps it and accumulates unsharded fp32 gradients until the step's
  reduce-scatter;
- saved activations of one microbatch per stage, measured by a forward on fake tensors (shapes
  only) under `saved_tensors_hooks`, times the microbatches each schedule holds at its peak on that
  rank (from the schedule's own action order); with activation checkpointing, the one block being
  recomputed in backward comes on top;
- the bubble fraction of each schedule: theory where it has a closed form, and simulated.

compile and float8 are left out of the dry run: neither runs on fake CPU tensors, and neither
changes the parameter accounting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining.schedules import BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, OVERLAP_F_B, _Action
from torch.distributed.tensor import DTensor

from pp_tp.config import JobConfig, ParallelConfig, validate
from pp_tp.errors import ConfigError
from pp_tp.mesh import MESH_DIMS, mesh_shape
from pp_tp.models.factory import build_model
from pp_tp.parallel.activation_checkpoint import is_checkpointed
from pp_tp.parallel.apply import parallelize_stage
from pp_tp.parallel.fsdp import uses_fsdp
from pp_tp.schedules.loss import TokenSumLoss
from pp_tp.schedules.registry import check_schedule, get_schedule_spec, is_csv_schedule
from pp_tp.stages.layouts import layout_for
from pp_tp.stages.plan import StagePlan, StageSpec, plan_stages
from pp_tp.stages.stage_module import StageModule
from pp_tp.timeline import bubble_fraction, schedule_actions, simulate, theoretical_bubble

FP32 = 4
ADAM_STATES = 2  # exp_avg and exp_avg_sq, fp32, on the local shard
_DP_DIMS = ("dp_replicate", "dp_shard")
# Schedules compared against the configured one, by stage->rank mapping and stages per rank.
_SINGLE_STAGE = ("GPipe", "1F1B")
_LOOPED_MULTI = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")


@dataclass
class RankMemory:
    """Bytes one rank of a pp stage group holds (at dp/tp coordinate 0)."""

    pp_rank: int
    stages: list[int]
    local_params: int
    param_bytes: int
    gathered_bytes: int
    grad_bytes: int
    grad_accum_bytes: int
    optim_bytes: int
    act_bytes_per_microbatch: dict[int, int]
    act_peak_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.param_bytes + self.gathered_bytes + self.grad_bytes + self.grad_accum_bytes + self.optim_bytes
                + self.act_peak_bytes)


@dataclass
class ScheduleEstimate:
    name: str
    bubble_theory: float | None
    bubble_simulated: float
    act_peak_bytes: list[int]  # per pp rank
    peak_microbatches: list[float]  # per pp rank: peak held / one microbatch through all of the rank's stages


@dataclass
class JobPlan:
    cfg: JobConfig
    world_size: int
    mesh: dict[str, int]
    microbatch: int
    plan: StagePlan
    ranks: list[RankMemory]
    schedules: list[ScheduleEstimate]
    seconds: float


# ---------------------------------------------------------------------------------------------
# The fake world


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """This process as rank 0 of a `world_size` world on torch's fake backend, for the `with` block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise ConfigError("pp-tp plan: a process group already exists in this process; run the dry run in a "
                          "process of its own (the `pp-tp plan` command does)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Parameters


def tp_local_numel(p: torch.Tensor) -> int:
    """Elements of the parameter as one TP rank computes with it (all-gathered over DP, still TP-sharded)."""
    if not isinstance(p, DTensor):
        return p.numel()
    names = p.device_mesh.mesh_dim_names or ()
    split = 1
    for i, placement in enumerate(p.placements):
        if placement.is_shard() and (i >= len(names) or names[i] not in _DP_DIMS):
            split *= p.device_mesh.size(i)
    return p.numel() // split


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


@dataclass(frozen=True)
class _StageCost:
    """What one stage costs a rank: local parameter elements, their TP-local (DP-gathered) count, and the
    saved activations of one microbatch."""

    local: int
    tp_local: int
    act_bytes: int


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()


class _Held:
    """What autograd keeps for one saved tensor; its finalizer tells SavedActivations it was dropped."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedActivations:
    """Live bytes autograd holds for backward while the `with` block runs (and after, until freed).

    Counted: tensors saved for backward, and the inputs of activation-checkpointed modules (what a
    checkpoint keeps to recompute from; what it saves inside is not held). Each storage counts once;
    the module's parameters and buffers (and views of them) are not activations. A tensor is released
    when autograd drops it (its graph is freed), so `peak` is the most held at once: over one forward,
    everything it saved; over a pipeline step, the schedule's peak. Home-made: torch's memory trackers
    are private (torch.distributed._tools) and count every allocation, not what autograd keeps.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage id -> [bytes, holders alive]
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)
        self._handles: list = []

    def _track(self, t: torch.Tensor, holder: object) -> None:
        """Counts `t`'s storage until `holder` is garbage-collected."""
        storage = _storage(t)
        key = storage._cdata
        if key in self._refs:
            self._refs[key][1] += 1
        elif key not in {_storage(x)._cdata for x in (*self.module.parameters(), *self.module.buffers())}:
            self._refs[key] = [storage.nbytes(), 1]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            return
        weakref.finalize(holder, self._release, key)

    def _pack(self, t: torch.Tensor) -> _Held:
        holder = _Held(t)
        self._track(t, holder)
        return holder

    def _checkpoint_inputs(self, module: nn.Module, args: tuple) -> None:
        for a in args:
            if isinstance(a, torch.Tensor):
                self._track(a, a)

    def _release(self, key: int) -> None:
        ref = self._refs[key]
        ref[1] -= 1
        if ref[1] == 0:
            self.live -= ref[0]
            del self._refs[key]

    def __enter__(self) -> "SavedActivations":
        self._handles = [m.register_forward_pre_hook(self._checkpoint_inputs) for m in self.module.modules()
                         if is_checkpointed(m)]
        self._saved_hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._saved_hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()


def _stage_activation_bytes(stage: StageModule, mesh: DeviceMesh, pcfg: ParallelConfig, microbatch: int,
                            seq: int, dim: int) -> int:
    """Saved activations of one microbatch through `stage` (and its loss, on the last stage), on fake tensors."""
    act_dtype = torch.bfloat16 if pcfg.mixed_precision == "bf16" else torch.float32
    stage.to_empty(device="cpu")
    if stage.is_first:
        x = torch.zeros(microbatch, seq, dtype=torch.long)
    else:
        x = torch.empty(microbatch, seq, dim, dtype=act_dtype, requires_grad=True)
    with SavedActivations(stage) as saved:
        out = stage(x)
        if stage.is_last:
            labels = torch.zeros(microbatch, seq, dtype=torch.long)
            loss = TokenSumLoss(mesh["tp"] if pcfg.loss_parallel and pcfg.tp > 1 else None)
            with loss.parallel():
                loss(out, labels)
    return saved.peak


def _stage_cost(stage: StageModule, mesh: DeviceMesh, pcfg: ParallelConfig, microbatch: int, seq: int, dim: int,
                fake: FakeTensorMode) -> _StageCost:
    """Parallelizes `stage` on meta (the real passes, on the fake world's mesh) and measures it."""
    parallelize_stage(stage, mesh, pcfg)
    local = sum(_local_numel(p) for p in stage.parameters())
    with fake, warnings.catch_warnings():  # one mode for all stages: shared modules (rotary tables) stay in it
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # the output view is never modified
        acts = _stage_activation_bytes(stage, mesh, pcfg, microbatch, seq, dim)
    return _StageCost(local, sum(tp_local_numel(p) for p in stage.parameters()), acts)


def _rank_memory(pp_rank: int, stages: list[int], costs: list[_StageCost], pcfg: ParallelConfig) -> RankMemory:
    """Parameter, gathered-copy, gradient, optimizer and activation bytes of one pp rank's stages."""
    local = sum(c.local for c in costs)
    gathered_bytes = grad_accum_bytes = 0
    if uses_fsdp(pcfg):
        # torch's PipelineStage runs every backward with reshard_after_backward and gradient sync off, so
        # whatever the reshard policy each unit stays gathered (param dtype) from its first backward, and
        # its unsharded gradients accumulate (fp32), until the step's one gradient reduction.
        tp_local = sum(c.tp_local for c in costs)
        gathered_bytes = (2 if pcfg.mixed_precision == "bf16" else FP32) * tp_local
        grad_accum_bytes = FP32 * tp_local
    return RankMemory(pp_rank, stages, local, param_bytes=local * FP32, gathered_bytes=gathered_bytes,
                      grad_bytes=local * FP32, grad_accum_bytes=grad_accum_bytes,
                      optim_bytes=ADAM_STATES * local * FP32,
                      act_bytes_per_microbatch={s: c.act_bytes for s, c in zip(stages, costs)})


def peak_held_bytes(actions: list[_Action], bytes_per_stage: dict[int, int]) -> int:
    """The most activation bytes a rank holds at once running `actions` in order: a forward adds its
    stage's microbatch bytes, a full backward (or, split, the weight backward) frees them."""
    held = peak = 0
    for action in actions:
        for a in action.sub_actions if action.computation_type == OVERLAP_F_B else (action,):
            if a.computation_type == FORWARD:
                held += bytes_per_stage[a.stage_index]
            elif a.computation_type in (FULL_BACKWARD, BACKWARD_WEIGHT):
                held -= bytes_per_stage[a.stage_index]
            peak = max(peak, held)
    return peak


# ---------------------------------------------------------------------------------------------
# Schedules


def _candidate_schedules(pcfg: ParallelConfig) -> list[str]:
    """The configured schedule and the built-in ones that run the same stages on the same ranks."""
    names = [pcfg.schedule]
    if not is_csv_schedule(pcfg.schedule) and get_schedule_spec(pcfg.schedule).mapping == "loop":
        names += _SINGLE_STAGE if pcfg.stages_per_rank == 1 else _LOOPED_MULTI
    out = []
    for name in dict.fromkeys(names):
        try:
            check_schedule(pcfg.pp, pcfg.stages_per_rank, pcfg.microbatches, name)
        except ConfigError:
            continue
        out.append(name)
    return out


def _schedule_estimate(name: str, pcfg: ParallelConfig, ranks: list[RankMemory]) -> ScheduleEstimate:
    actions = schedule_actions(name, pcfg.pp, pcfg.microbatches, pcfg.stages_per_rank)
    peaks = [peak_held_bytes(actions[r.pp_rank], r.act_bytes_per_microbatch) for r in ranks]
    per_mb = [sum(r.act_bytes_per_microbatch.values()) for r in ranks]
    return ScheduleEstimate(name, theoretical_bubble(name, pcfg.pp, pcfg.microbatches, pcfg.stages_per_rank),
                            max(bubble_fraction(simulate(actions))), peaks,
                            [p / b if b else 0.0 for p, b in zip(peaks, per_mb)])


# ---------------------------------------------------------------------------------------------
# The dry run


def _kind(spec: StageSpec) -> tuple[bool, int, bool]:
    return spec.embed, len(spec.blocks), spec.head


def plan_job(cfg: JobConfig, world_size: int) -> JobPlan:
    """Dry-runs `cfg` on `world_size` ranks in this process; nothing is allocated and nobody is contacted."""
    t0 = time.perf_counter()
    cfg = validate(cfg, world_size)
    # compile and float8 do not run on fake CPU tensors; they leave the accounting unchanged.
    pcfg = dataclasses.replace(cfg.parallel, compile=False, float8=False)
    microbatch = cfg.training.batch_size // (pcfg.dp * pcfg.microbatches)
    shape = mesh_shape(pcfg, world_size)
    with fake_world(world_size):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
        model = build_model(cfg.model, "meta")
        layout = layout_for(model)
        plan = plan_stages(model, layout, pcfg, cfg.training.seq_len)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        # Blocks of one model are alike: stages with the same (embed, block count, head) cost the same,
        # so each kind is parallelized and measured once (a 405B-like plan has 4 kinds of 32 stages).
        kinds: dict[tuple[bool, int, bool], _StageCost] = {}
        for spec in plan.stages:
            if _kind(spec) not in kinds:
                kinds[_kind(spec)] = _stage_cost(StageModule(model, layout, spec), mesh, pcfg, microbatch,
                                                 cfg.training.seq_len, layout.dims(model).dim, fake)
        ranks = [_rank_memory(r, [s.index for s in plan.for_rank(r)], [kinds[_kind(s)] for s in plan.for_rank(r)],
                              pcfg) for r in range(pcfg.pp)]
    schedules = [_schedule_estimate(name, pcfg, ranks) for name in _candidate_schedules(pcfg)]
    configured = schedules[0]
    for r, peak in zip(ranks, configured.act_peak_bytes):
        r.act_peak_bytes = peak
    return JobPlan(cfg, world_size, dict(zip(MESH_DIMS, shape)), microbatch, plan, ranks, schedules,
                   time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# Printing


def _size(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (GiB at most)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _table(rows: list[tuple]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)


def format_plan(job: JobPlan) -> str:
    """The dry run as text: mesh, stage table, per-rank memory, schedules."""
    p, t, m = job.cfg.parallel, job.cfg.training, job.cfg.model
    mesh = " x ".join(f"{k}={v}" for k, v in job.mesh.items())
    fsdp = f"FSDP reshard_after_forward={p.fsdp_reshard_after_forward}" if uses_fsdp(p) else "no FSDP"
    lines = [
        f"world: {job.world_size} ranks (fake process group); mesh {mesh}",
        f"model: dim={m.dim} layers={m.n_layers} heads={m.n_heads}/{m.n_kv_heads or m.n_heads} ffn={m.ffn_dim} "
        f"vocab={m.vocab_size}; batch {t.batch_size} x seq {t.seq_len}, microbatch {job.microbatch} x "
        f"{p.microbatches} per DP rank; {p.mixed_precision}; {fsdp}; activation checkpoint {p.activation_checkpoint}",
        "",
        "stages:",
        job.plan.table(),
        "",
        f"memory per rank (dp/tp coordinate 0; schedule {p.schedule}; AdamW):",
    ]
    rows = [("pp rank", "stages", "local params", "params", "gathered", "grads", "grad accum", "optimizer",
             "act/microbatch", "act peak", "total")]
    for r in job.ranks:
        rows.append((r.pp_rank, ",".join(map(str, r.stages)), f"{r.local_params:,}", _size(r.param_bytes),
                     _size(r.gathered_bytes), _size(r.grad_bytes), _size(r.grad_accum_bytes), _size(r.optim_bytes),
                     _size(sum(r.act_bytes_per_microbatch.values())), _size(r.act_peak_bytes),
                     _size(r.total_bytes)))
    lines += [_table(rows), "",
              "schedules (bubble = idle / compute time per rank; act peak = max over pp ranks):"]
    rows = [("schedule", "bubble theory", "bubble simulated", "act peak", "microbatches held (rank 0 .. last)")]
    for s in job.schedules:
        theory = f"{s.bubble_theory:.4f}" if s.bubble_theory is not None else "-"
        held = " ".join(f"{x:.1f}" for x in s.peak_microbatches)
        rows.append((s.name + (" *" if s is job.schedules[0] else ""), theory, f"{s.bubble_simulated:.4f}",
                     _size(max(s.act_peak_bytes)), held))
    lines += [_table(rows), "", f"(* configured; dry run took {job.seconds:.1f} s)"]
    return "\n".join(lines)
