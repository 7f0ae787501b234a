"""The Pipeline runner: one `step(input_ids, labels)` (a language model) or `step(inputs, targets)` (any model with
the caller's loss) on every rank, whatever stages the rank holds.

Stage input/output shapes are given to torch's PipelineStage up front (static metadata), so no step
pays for shape inference. A batch of another shape re-plans the stages locally (no communication), once:
the schedule of each recent shape is kept. Every rank must see the same shape, as they do when the data loader
feeds equal local batches.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from operator import attrgetter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import RESHARD, UNSHARD

from pp_tp.base._torch import Action, PipelineScheduleRuntime, load_csv_schedule
from pp_tp.errors import ConfigError
from pp_tp.hf_checkpoint import save_pretrained
from pp_tp.layout import check_document_mask
from pp_tp.parallel.context_parallel import ContextParallel
from pp_tp.parallel.mesh import dp_rank, token_groups
from pp_tp.parallel.rng import StageStream
from pp_tp.parallel.tensor_parallel import reduce_partial_grads
from pp_tp.runtime.balancing import Balancing
from pp_tp.runtime.built import BuiltStages
from pp_tp.runtime.evaluate import forward_only, grad_state, kept_grads
from pp_tp.runtime.extras import ExtrasLoss, RowLoss, per_call, shard_extras
from pp_tp.runtime.full_state import iter_full_state_dict
from pp_tp.runtime.grad_reduce import ReducingStage
from pp_tp.runtime.logprobs import logprobs
from pp_tp.runtime.loss import TokenSumLoss, count_targets, count_tokens, loss_scale
from pp_tp.schedules.registry import get_schedule_spec, is_csv_schedule


def _gather_params_once(schedule: PipelineScheduleRuntime) -> None:
    """Keeps FSDP params gathered for the whole step on multi-stage schedules (fixes pytorch#164756).

    torch's lowering interleaves UNSHARD/RESHARD per stage as its window of active stages moves, so
    with more than a few stages per rank a unit is all-gathered several times per step. Here every
    local stage is unsharded once before the first action and resharded once after the last one;
    gradients are still reduce-scattered once per stage, by its last backward (runtime/grad_reduce.py).
    """
    order = schedule.pipeline_order_with_comms
    for rank, actions in order.items():
        local = sorted(
            {
                leaf.stage_index
                for a in actions
                if a.computation_type not in (UNSHARD, RESHARD)
                for leaf in (a.sub_actions or (a,))
            }
        )  # OVERLAP_F_B has stage -1, its parts real ones
        body = [a for a in actions if a.computation_type not in (UNSHARD, RESHARD)]
        order[rank] = [Action(s, UNSHARD, None) for s in local] + body + [Action(s, RESHARD, None) for s in local]


SCHEDULES_KEPT = 8  # microbatch shapes whose schedule a Pipeline keeps (Pipeline._schedule_for)


class Pipeline:
    """Runs one training step of the pipelined model; see docs/design.md for the contract.

    It keeps `_built` (what build_pipeline made for this rank) and `options` (what the caller asked for) whole and
    reads them where they are used; `__init__` sets only what is derived from them or changes as the run goes."""

    def __init__(self, built: BuiltStages):
        self._built, self.options = built, built.options
        self.model_parts: list[nn.Module] = list(built.stages)
        self.stage_indices = [s.spec.index for s in built.stages]
        self.has_first_stage = any(s.is_first for s in built.stages)
        self.has_last_stage = any(s.is_last for s in built.stages)
        # Dropout draws from one stream per (seed, stage, dp rank) (parallel/rng.py); checkpoints keep their states.
        self.rng_streams = [
            StageStream(s, built.options.dropout_seed, s.spec.index, dp_rank(built.mesh), built.mesh.device_type)
            for s in built.stages
        ]
        self._targets = built.loss is not None  # step(inputs, targets) with the caller's loss
        self._loss = built.loss if built.loss is not None else TokenSumLoss(built.tp_loss_mesh)
        self._rows = RowLoss(self._loss)  # the schedule's loss: ours, or a per-call loss over rows (runtime/extras.py)
        self._pp_group = built.mesh.get_group("pp")
        self._dp_groups = token_groups(built.mesh)
        self._cp = ContextParallel(built.mesh) if built.pcfg.cp > 1 else None
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()  # (microbatch shape, dtype) -> schedule, LRU
        self.schedule = None
        self.balancing = Balancing(built)  # MoE routing counts, auxiliary loss, expert biases

    # The contract's attributes (docs/design.md), read through from what the pipeline keeps whole: never copies.
    plan = property(attrgetter("_built.plan"), doc="StagePlan: which FQNs each stage owns, which pp rank runs it.")
    mesh = property(attrgetter("_built.mesh"), doc="DeviceMesh: the 4-D mesh the pipeline runs on.")
    pcfg = property(attrgetter("_built.pcfg"), doc="ParallelConfig as resolved for this world (dp_shard, stages).")
    device = property(attrgetter("_built.device"), doc="torch.device: this rank's device.")
    hf_config = property(attrgetter("_built.hf_config"), doc="The model's HF config (else None): its config.json.")
    source_dir = property(attrgetter("options.hf_source_dir"), doc="The HF dir whose generation_config.json stays.")
    checkpoint_casts = property(attrgetter("_built.checkpoint_casts"), doc="Counter: dtype casts of an HF load.")
    moe_stats = property(attrgetter("balancing.stats"), doc="The last step's MoE aux loss and tokens per expert.")

    def _schedule_for(self, key: tuple) -> Any:
        """The schedule of a microbatch (shape, dtype): built on the first batch of that shape (stage shapes, then
        PipelineStages), then kept for the last `SCHEDULES_KEPT` shapes, so lengths that come back (logprobs or steps
        of varying sequence length) build nothing; each kept one holds its stages' receive buffers, hence a bound."""
        if key in self._schedules:
            self._schedules.move_to_end(key)
        else:
            self._schedules[key] = self._build_schedule(*key)
            if len(self._schedules) > SCHEDULES_KEPT:
                self._schedules.popitem(last=False)
        return self._schedules[key]

    def _build_schedule(self, microbatch: tuple[int, ...], dtype: torch.dtype) -> Any:
        shapes = self._built.shapes(microbatch, dtype)
        num_stages = self.pcfg.num_stages
        pstages = []
        m = self.pcfg.microbatches
        fsdp = self._built.fsdp
        # the last backward reduces from FSDP's own hooks, as plain FSDP2 does: no unsharded fp32 copy per parameter
        reducing = dict(policy=fsdp, microbatches=m) if fsdp.shards else {}
        for stage in self.model_parts:
            inp, out = shapes.stage_io(stage)
            pstages.append(
                (ReducingStage if reducing else PipelineStage)(
                    stage,
                    stage.spec.index,
                    num_stages,
                    self.device,
                    input_args=inp,
                    output_args=out,
                    group=self._pp_group,
                    **reducing,
                )
            )
        name = self.pcfg.schedule
        if is_csv_schedule(name):
            schedule = PipelineScheduleRuntime(pstages, n_microbatches=m, loss_fn=self._rows, scale_grads=False)
            load_csv_schedule(schedule, name)
        else:
            spec = get_schedule_spec(name)
            schedule = spec.cls(
                pstages if spec.multi_stage else pstages[0], n_microbatches=m, loss_fn=self._rows, scale_grads=False
            )
        if isinstance(schedule, PipelineScheduleRuntime) and fsdp.keeps_params_gathered:
            _gather_params_once(schedule)
        return schedule

    def _check_batch(self, where: str, inputs: torch.Tensor, targets: torch.Tensor | None) -> None:
        if not self._targets:
            if targets is None or inputs.shape != targets.shape or inputs.dim() != 2:
                got = None if targets is None else tuple(targets.shape)
                raise ConfigError(
                    f"{where}: input_ids {tuple(inputs.shape)} and labels {got} must both be [batch, seq]"
                )
        elif targets is None and self.has_last_stage:
            raise ConfigError(f"{where}: this rank holds the last stage, so it needs the targets; pass them")
        elif targets is not None and targets.shape[:1] != inputs.shape[:1]:
            raise ConfigError(
                f"{where}: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} differ in batch size; "
                "give one target per sample"
            )

    def prepare_batch(
        self, where: str, inputs: torch.Tensor, targets: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | int]:
        """Checks this DP rank's batch, (re)plans the stages for its microbatch shape, moves it to the device and
        counts the loss's global normalizer (non-ignored tokens, or the caller's loss's count, on the ranks holding
        the last stage: only they need it), a float64 tensor on the device (no host read); shared by `step` and
        `evaluate`."""
        self._check_batch(where, inputs, targets)
        batch, m = inputs.shape[0], self.pcfg.microbatches
        if batch % m:
            raise ConfigError(
                f"{where}: local batch {batch} is not divisible by parallel.microbatches = {m}; "
                f"use a batch that is a multiple of {m}"
            )
        key = ((batch // m, *inputs.shape[1:]), inputs.dtype)
        self.schedule = self._schedule_for(key)
        inputs = inputs.to(self.device)
        targets = targets.to(self.device) if targets is not None else None
        if not self._targets:
            return inputs, targets, count_tokens(targets, self._dp_groups)
        n = count_targets(targets, self._loss.normalizer, self._dp_groups) if self.has_last_stage else 1
        return inputs, targets, n

    def global_loss(
        self, losses: list[torch.Tensor], divide: float = 1.0, aux: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The sum of the last stage's microbatch losses (over `divide`), summed over pp and DP: every rank gets
        the global loss. Summed on the device: no host sync per microbatch. With `aux` (this rank's auxiliary-loss
        sum), [loss, aux summed over pp and DP] in the same all-reduce."""
        total = torch.zeros(1 if aux is None else 2, dtype=torch.float64, device=self.device)
        if losses:
            total[0] += torch.stack([x.detach() for x in losses]).double().sum() / divide
        if aux is not None:
            total[1] = aux
        for g in [self._pp_group] + self._dp_groups:
            dist.all_reduce(total, group=g)
        total = total.to(torch.float64 if self.pcfg.dtype == "float64" else torch.float32)
        return total if aux is not None else total[0]

    def _check_positions(self, where: str, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        """Packed documents' position ids: a layout that takes them, the shape of the input ids."""
        if position_ids is None:
            return
        check_document_mask(self.model_parts[0].layout)
        if position_ids.shape != input_ids.shape:
            raise ConfigError(
                f"{where}: position_ids {tuple(position_ids.shape)} must have the shape of input_ids "
                f"{tuple(input_ids.shape)}"
            )

    def _schedule_kwargs(self, inputs: torch.Tensor, position_ids: torch.Tensor | None) -> dict:
        """The schedule's keyword inputs, split into microbatches by torch as it splits the inputs and handed to every
        stage's forward: per-token position ids when the batch packs documents or runs under context parallel; the
        token ids (this rank's, on the device) where the model's blocks read them, on every stage (the layout says
        so, the same on every rank)."""
        kwargs = {} if position_ids is None else {"position_ids": position_ids.to(self.device)}
        if self.model_parts[0].layout.block_ids:
            kwargs["input_ids"] = inputs
        return kwargs

    def _context_shard(
        self, where: str, inputs: torch.Tensor, targets: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Under context parallel, this cp rank's head-tail chunks of the rows (inputs, labels) and their positions,
        which reach every stage as the schedule's `position_ids`; the batch as it is otherwise."""
        if self._cp is None:
            return inputs, targets, position_ids
        self._check_batch(where, inputs, targets)
        self._cp.check_seq(where, inputs.shape[1])
        for stage in self.model_parts:  # the attention masks of this step: inside documents, or not
            stage.context_parallel.documents = position_ids is not None
        if position_ids is None:
            position_ids = self._cp.local_positions(inputs.shape[0], inputs.shape[1], inputs.device)
        else:
            position_ids = self._cp.shard(position_ids)
        return self._cp.shard(inputs), self._cp.shard(targets), position_ids

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        extras: dict[str, torch.Tensor] | None = None,
        loss_fn: ExtrasLoss | str | None = None,
    ) -> torch.Tensor:
        """One forward/backward over this DP rank's batch; returns the global loss on every rank: the mean token loss
        (`inputs` = input_ids, `targets` = labels), or with the caller's loss its sum over the global normalizer
        (targets needed only where the last stage is). `position_ids` ([batch, seq], restarting at 0 at every packed
        document) keep each token's attention and positions inside its own document; the model's layout must offer
        `document_block_inputs`. Under context parallel each cp rank runs its head-tail chunks of the same rows.
        `loss_fn(output, targets, extras) -> sum` (or "grpo", runtime/policy_loss.py) replaces the loss for this call,
        `extras` ([B] or [B, S] tensors) split into microbatches as the targets are (runtime/extras.py)."""
        self._check_positions("Pipeline.step", inputs, position_ids)
        call_loss, extras = per_call("Pipeline.step", inputs, extras, loss_fn, self.options)  # checked: one line
        inputs, targets, position_ids = self._context_shard("Pipeline.step", inputs, targets, position_ids)
        inputs, targets, n = self.prepare_batch("Pipeline.step", inputs, targets)
        extras = shard_extras(extras, self._cp, self.device)
        kwargs = self._schedule_kwargs(inputs, position_ids)
        self._loss.scale = loss_scale(self._built.grad_factor, n)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first_stage else ()
        target = targets if self.has_last_stage else None
        with contextlib.ExitStack() as ctx:
            ctx.enter_context(self._loss.parallel())  # torch wants the vocab-parallel loss's backward inside it too
            target = ctx.enter_context(self._rows.route(call_loss, target, extras))  # row indices with a call's loss
            for stage in self.model_parts:  # masks and rotary tables once per step, not once per microbatch
                ctx.enter_context(stage.reuse_block_inputs())
            self.balancing.start_step()
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        self.balancing.end_step()
        reduce_partial_grads(self.model_parts)  # once per step, after the last microbatch
        if self._built.tied is not None:
            self._built.tied.sync(self.model_parts)
        if self.balancing.aux is None:
            return self.global_loss(losses, self._built.grad_factor)
        loss, aux = self.global_loss(losses, self._built.grad_factor, self.balancing.aux.total)
        self.balancing.record_aux(aux)
        return loss

    def update_expert_bias(self) -> None:
        """Moves every local MoE layer's expert bias by moe.bias_update_rate * sign(mean_e(c) - c_e), c = the last
        step's tokens per expert (global); call it after `optimizer.step()`. No communication; a no-op at rate 0."""
        self.balancing.update_expert_bias()

    def logprobs(
        self, inputs: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """float32 [batch, seq]: log p(label) of each token of this DP rank's rows (0.0 where -100), forward-only,
        on every rank; vocab-parallel under parallel.loss_parallel, whole sequences under cp (runtime/logprobs.py)."""
        return logprobs(self, inputs, labels, position_ids)

    def iter_full_state_dict(self, checkpoint_names: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) of the whole model, one at a time, on every rank (a collective every rank drains):
        what a trainer hands an inference engine between updates (runtime/full_state.py)."""
        return iter_full_state_dict(self.model_parts, self.mesh, self.device, self.hf_config, checkpoint_names)

    def save_pretrained(self, path: str, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None) -> None:
        """Writes the whole model to `path` in HF format (a collective; each pp rank writes its stages' files)."""
        save_pretrained(self.model_parts, self.mesh, path, self.hf_config, self.source_dir, max_shard_size, dtype)

    @torch.no_grad()
    def evaluate(
        self, inputs: torch.Tensor, targets: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Forward-only global loss of this DP rank's batch share (validation), as `step` defines it; every rank
        calls it, and no gradient is created or changed (checked). `position_ids` and context parallel as in `step`."""
        self._check_positions("Pipeline.evaluate", inputs, position_ids)
        inputs, targets, position_ids = self._context_shard("Pipeline.evaluate", inputs, targets, position_ids)
        inputs, labels, n_tokens = self.prepare_batch("Pipeline.evaluate", inputs, targets)
        kwargs = self._schedule_kwargs(inputs, position_ids)
        before = grad_state(self.model_parts)
        scale = self._loss.scale
        self._loss.scale = loss_scale(1.0, n_tokens)  # nothing flows back, so no FSDP mean to undo
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first_stage else ()
        try:
            with kept_grads(self.model_parts), self._loss.parallel(), forward_only(self.schedule):
                self.schedule.eval(*args, target=labels if self.has_last_stage else None, losses=losses,
                                   return_outputs=False, **kwargs)  # fmt: skip
        finally:
            self._loss.scale = scale
        changed = [k for k, v in grad_state(self.model_parts).items() if before[k] != v]
        if changed:
            raise AssertionError(f"Pipeline.evaluate changed the gradient of {changed[0]}; it must be forward-only")
        return self.global_loss(losses)
