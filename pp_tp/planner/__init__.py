"""`pp-tp plan`: a dry run of a job in one process, at any world size, with no memory and no peers.

torch's `fake` process-group backend stands in for the world (collectives return at once), so the
real mesh and the runtime's own build run unchanged on the meta device: `preflight` (every model rule, the
stage plan) and `build_local_stages` (prune, TP, experts, AC, FSDP) once per distinct stage
(pp_tp.planner.stage_build), so the planner refuses what a run refuses with the same line. Per pp rank, at
dp/tp coordinate 0 (the largest FSDP shard), it reports:

- parameter, gradient and AdamW bytes read off the sharded parameters themselves (DTensor local
  shapes, FSDP padding included); FSDP keeps fp32 shards, all-gathers a compute copy in the param
  dtype, and under pipelining keeps it and accumulates unsharded fp32 gradients until the step's
  reduce-scatter;
- saved activations of one microbatch per stage, measured by a forward on fake tensors (shapes
  only) under `saved_tensors_hooks`, times the microbatches each schedule holds at its peak on that
  rank (from the schedule's own action order); with activation checkpointing, what the recompute of one
  module saves comes on top;
- torch's PipelineStage receive buffers (one per microbatch, activations and gradients, kept across
  steps) and the gradients a backward holds beyond the saved activations (memory.boundary_extras);
  tests/test_planner_memory.py checks the total against a real run's measured peak;
- the bubble fraction of each schedule: theory where it has a closed form, and simulated.
- for a mixture of experts (pp_tp.planner.moe): experts per rank and the expert-parallel all-to-all bytes of a
  step, under balanced routing (the fake forward's dispatch assumes it too); stages are measured per kind of
  block, so dense and MoE layers of one model cost apart.
- under context parallel (pp_tp.planner.context): the stage forward runs as a cp rank runs it (seq / cp tokens, the
  K/V all-gather on the fake group, so the gathered keys and values and the masks attention saves are measured),
  FSDP shards over dp_shard x cp, the masks each stage caches are kept across steps, and the K/V all-gather bytes
  of a step (analytic: the fake group moves nothing) are reported and charged by `--search`, which tries cp too.

compile and float8 are left out of the dry run: neither runs on fake CPU tensors, and neither
changes the parameter accounting.
"""

from __future__ import annotations

from pp_tp.planner.activations import SavedActivations
from pp_tp.planner.dry_run import plan_job
from pp_tp.planner.memory import peak_held_bytes, tp_local_numel
from pp_tp.planner.report import format_plan
from pp_tp.planner.resolve import resolve_auto

__all__ = ["SavedActivations", "format_plan", "peak_held_bytes", "plan_job", "resolve_auto", "tp_local_numel"]
