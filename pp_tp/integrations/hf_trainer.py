"""Pipeline parallel inside transformers' Trainer: `PipelineTrainer(..., parallel=...)` builds the mesh and the
pipeline from the model it is given and trains with Trainer's own loop (arguments, collators, callbacks, logging,
LR schedulers, evaluation, checkpoints).

The seams: the loop still walks `gradient_accumulation_steps` micro-batches per optimizer step; `training_step`
keeps them and runs one `Pipeline.step` over the merged rows at the last one (the schedule's microbatches), returning
the step's global token-weighted loss there and 0 before, so Trainer's logged loss is the one it logs on one process.
Clipping is pp_tp's across stages, evaluation `Pipeline.evaluate`, the model is saved by `Pipeline.save_pretrained`,
and the optimizer, scheduler and RNG states go to the files Trainer writes on one process (hf_trainer_state.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME

from pp_tp.build import build_pipeline
from pp_tp.config import ParallelConfig, load_config
from pp_tp.errors import ConfigError
from pp_tp.integrations import hf_trainer_state as states
from pp_tp.integrations.hf_trainer_batches import dp_share, merge_rows, one_process_loaders
from pp_tp.parallel.grads import clip_grad_norm_, total_grad_norm
from pp_tp.parallel.mesh import build_mesh, dp_rank, dp_size

__all__ = ["PipelineTrainer", "PipelineTrainerMixin"]

# Optimizers with per-parameter state only (a shard's state is the shard of the whole parameter's).
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop")


class StageParts(nn.Module):
    """What Trainer holds as `self.model` once the pipeline is built: this rank's stages (their parameters are the
    optimizer's, named `parts.<i>.<full model name>`) and the model's config. The pipeline runs the model, a whole
    step's rows at a time, so calling it is refused."""

    def __init__(self, parts: list[nn.Module], config: Any):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.config = config

    def forward(self, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None, labels: Any = None,
                shift_labels: Any = None) -> None:  # fmt: skip
        """Its parameters name the batch keys Trainer keeps (the pipeline's inputs, hf_trainer_batches.merge_rows)."""
        raise ConfigError("PipelineTrainer: the model runs through its pipeline (Pipeline.step), not model(...)")

    def activation_checkpointing_enable(self, **kwargs: Any) -> None:
        """Trainer's call for gradient checkpointing: the stages have parallel.activation_checkpoint already."""

    def full_names(self) -> dict[int, str]:
        """Each local parameter's id -> its full model name (a tied copy's: the canonical one)."""
        return {
            id(p): getattr(part, "checkpoint_keys", {}).get(n, n)
            for part in self.parts
            for n, p in part.named_parameters()
        }


def parallel_config(parallel: ParallelConfig | str | dict | None, args: TrainingArguments) -> ParallelConfig:
    """The [parallel] config: a ParallelConfig, a dict of its keys, or a TOML path; `microbatches` left unset (or at
    its default, 1) becomes gradient_accumulation_steps, the precision follows `bf16`, and gradient (activation)
    checkpointing is parallel.activation_checkpoint = "full" unless that key says otherwise."""
    if isinstance(parallel, str):
        pcfg = load_config(parallel).parallel
    elif isinstance(parallel, dict):
        pcfg = ParallelConfig(**parallel)
    elif parallel is None:
        pcfg = ParallelConfig()
    else:
        pcfg = parallel
    if pcfg.microbatches == ParallelConfig.microbatches:
        pcfg.microbatches = args.gradient_accumulation_steps
    pcfg.mixed_precision = "bf16" if args.bf16 else "fp32"
    if (args.gradient_checkpointing or args.activation_checkpointing) and pcfg.activation_checkpoint == "none":
        pcfg.activation_checkpoint = "full"  # every block recomputed in backward, as HF's checkpointing does
    rows = args.per_device_train_batch_size * args.gradient_accumulation_steps
    if rows % pcfg.microbatches:
        raise ConfigError(
            f"PipelineTrainer: per_device_train_batch_size x gradient_accumulation_steps = {rows} rows per DP rank "
            f"do not split into parallel.microbatches = {pcfg.microbatches}; use a divisor of {rows}"
        )
    return pcfg


def _optim(args: TrainingArguments) -> str:
    return getattr(args.optim, "value", args.optim)


def refuse(args: TrainingArguments, kwargs: dict[str, Any], pcfg: ParallelConfig) -> None:
    """What cannot work under a pipeline, refused by name before anything is built (no collective)."""
    rules = [
        (args.deepspeed, "deepspeed", "pp_tp shards with parallel.dp_shard (FSDP2); drop deepspeed"),
        (args.fsdp, "fsdp", "pp_tp shards with parallel.dp_shard (FSDP2); drop fsdp"),
        (args.parallelism_config, "parallelism_config", "use parallel= (pp, tp, dp_shard, ep, cp)"),
        (args.fp16, "fp16", "pp_tp's precisions are bf16 and fp32; use bf16=True"),
        (args.use_liger_kernel, "use_liger_kernel", "the pipeline runs the model's own layers; drop it"),
        (args.neftune_noise_alpha, "neftune_noise_alpha", "drop it"),
        (args.label_smoothing_factor, "label_smoothing_factor", "pp_tp's loss is plain token cross-entropy"),
        (args.auto_find_batch_size, "auto_find_batch_size", "set per_device_train_batch_size"),
        (args.load_best_model_at_end, "load_best_model_at_end", "load the best checkpoint with from_pretrained"),
        (args.push_to_hub, "push_to_hub", "push the saved directory yourself"),
        (not args.average_tokens_across_devices, "average_tokens_across_devices=False",
         "the pipeline's loss is over the global batch's tokens"),
        (args.train_sampling_strategy == "batch_rebalance", "train_sampling_strategy='batch_rebalance'",
         "use 'random', 'sequential' or 'group_by_length'"),
        (_optim(args) not in OPTIMIZERS, f"optim={_optim(args)}", f"use one of {', '.join(OPTIMIZERS)}"),
        (kwargs.get("model_init"), "model_init", "pass the model"),
        (kwargs.get("compute_loss_func"), "compute_loss_func", "the pipeline's loss is token cross-entropy"),
        (kwargs.get("compute_metrics"), "compute_metrics", "the logits stay on the last stage; eval gives the loss"),
        (kwargs.get("preprocess_logits_for_metrics"), "preprocess_logits_for_metrics", "eval gives the loss only"),
        (any(x is not None for x in kwargs.get("optimizers", ())), "optimizers",
         "a built optimizer holds the whole model's parameters; use optimizer_cls_and_kwargs"),
        (kwargs.get("peft_config"), "peft_config", "adapters are not built into pipeline stages"),
        (getattr(args, "activation_offloading", False), "activation_offloading", "drop it"),
        (getattr(args, "loss_type", "nll") != "nll", f"loss_type={getattr(args, 'loss_type', '')}", "use 'nll'"),
        (args.torch_compile != pcfg.compile, f"torch_compile={args.torch_compile} with parallel.compile = "
         f"{pcfg.compile}", "set both alike (pp_tp compiles each block)"),
    ]  # fmt: skip
    for bad, name, fix in rules:
        if bad:
            raise ConfigError(f"PipelineTrainer does not support {name}: {fix}")


class PipelineTrainerMixin:
    """The pipeline seams of Trainer; `PipelineTrainer` is this over `transformers.Trainer`, PipelineSFTTrainer over
    TRL's SFTTrainer. `parallel`: a ParallelConfig, a dict of its keys or a TOML path (its [parallel]); `mesh`: an
    existing mesh of that shape (else one is built on the default process group)."""

    def __init__(self, model: nn.Module, args: TrainingArguments | None = None, *rest: Any,
                 parallel: ParallelConfig | str | dict | None = None, mesh: Any = None, **kwargs: Any):  # fmt: skip
        args = args if args is not None else TrainingArguments(output_dir="tmp_trainer")
        pcfg = parallel_config(parallel, args)
        refuse(args, kwargs, pcfg)
        _ = args.device  # under torchrun accelerate starts the process group here
        meta = any(p.is_meta for p in model.parameters())
        source = getattr(model, "name_or_path", "") if meta else None
        if meta and not os.path.isdir(source or ""):
            raise ConfigError(
                f"PipelineTrainer: the model is on meta and its name_or_path {source!r} is no local directory; "
                "give a from_pretrained model, or a meta one whose config names its checkpoint directory"
            )
        self._pcfg, self._source = pcfg, source
        self.pipe = build_pipeline(model, mesh if mesh is not None else build_mesh(pcfg), pcfg, checkpoint=source)
        super().__init__(model, args, *rest, **kwargs)
        self._full_groups = states.trainer_groups(self.model, self.get_decay_parameter_names(self.model))
        self.gather_function = self._eval_copies
        self._hf_model = self.model
        self._set_stages()

    def _set_stages(self) -> None:
        self.model = self.model_wrapped = StageParts(self.pipe.model_parts, self._hf_model.config)
        self.callback_handler.model = self.model
        # evaluation_loop prepares (and moves) a model the accelerator does not hold: the stages are placed already
        self.accelerator.prepare_model(self.model, device_placement=False, evaluation_mode=True)
        self._dp, self._dp_rank = dp_size(self.pipe.mesh), dp_rank(self.pipe.mesh)
        self._pending: list[dict] = []

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """The pipeline placed each stage on this rank's device; the model given stays where it is."""

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        return model

    # ---- data: the one-process loader, dp times the rows per batch; each rank keeps its share --------------------
    def get_train_dataloader(self) -> Any:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        with one_process_loaders(self.accelerator):
            return self._get_dataloader(
                self.train_dataset, "Training", self.args.train_batch_size * self._dp, self._get_train_sampler,
                is_training=True,
            )  # fmt: skip

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        with one_process_loaders(self.accelerator):
            return self._get_dataloader(dataset, "Evaluation", self.args.eval_batch_size * self._dp,
                                        self._get_eval_sampler)  # fmt: skip

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        return args.train_batch_size * args.gradient_accumulation_steps * self._dp

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, None]:
        """This DP rank's rows of the next `num_batches` batches; the pipeline counts the step's tokens itself."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(dp_share(next(epoch_iterator), self._dp, self._dp_rank))
            except StopIteration:
                break
        return batches, None

    # ---- one optimizer step: one Pipeline.step over the kept micro-batches -------------------------------------
    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        model.train()
        self._pending.append(inputs)
        if len(self._pending) < self.current_gradient_accumulation_steps:
            return torch.zeros((), device=self.args.device)
        ids, labels, positions = merge_rows(self._pending)
        self._pending = []
        if ids.shape[0] % self._pcfg.microbatches:
            raise ConfigError(
                f"PipelineTrainer: this step has {ids.shape[0]} rows per DP rank, not divisible by "
                f"parallel.microbatches = {self._pcfg.microbatches}; set dataloader_drop_last=True"
            )
        return self.pipe.step(ids, labels, positions).to(self.args.device)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return clip_grad_norm_(self.pipe.model_parts, self.args.max_grad_norm, self.pipe.mesh)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return grad_norm if grad_norm is not None else total_grad_norm(self.pipe.model_parts, self.pipe.mesh)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            decay = set(self.get_decay_parameter_names(self.model))
            groups = states.param_groups(self.model.named_parameters(), decay, self.args.weight_decay)
            cls, kw = self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(self.args, self.model)
            self.optimizer = cls(groups, **kw)
        return self.optimizer

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None):
        """Trainer's preparation without accelerate's wrapping: the stages are placed and sharded already."""
        self.lr_scheduler = (
            None  # Trainer made it (a given one is refused): a new one per train() call, as Trainer does
        )
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model, train_dataloader

    # ---- evaluation: forward-only pipeline steps -------------------------------------------------------------
    def prediction_step(self, model: nn.Module, inputs: dict, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[torch.Tensor, None, None]:  # fmt: skip
        self._eval_rows = inputs["input_ids"].shape[0]
        ids, labels, positions = merge_rows([dp_share(inputs, self._dp, self._dp_rank)])
        return self.pipe.evaluate(ids, labels, positions).to(self.args.device), None, None

    def _eval_copies(self, losses: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Trainer's gather of the eval loss copies: every rank's loss is the global batch's already, so one copy per
        row of that batch, as one process counts a short last batch (a gather over the world would count each rank)."""
        return losses[:1].repeat(self._eval_rows)

    # ---- checkpoints: HF safetensors and Trainer's one-process files ------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The whole model as HF safetensors (every rank calls it; each pp rank writes its stages' files)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.pipe.save_pretrained(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        mesh = self.pipe.mesh
        writer = all(mesh.get_local_rank(d) == 0 for d in mesh.mesh_dim_names if d != "pp")
        path = os.path.join(output_dir, states.OPTIMIZER)
        states.save_optimizer(self.optimizer, self.model.full_names(), self._full_groups, writer, path)
        if self.args.should_save:
            classes = [g["trainer_group"] for g in self.optimizer.param_groups]
            sd = states.scheduler_state(self.lr_scheduler.state_dict(), classes, to_trainer=True)
            torch.save(sd, os.path.join(output_dir, states.SCHEDULER))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not os.path.isfile(os.path.join(checkpoint, states.OPTIMIZER)):
            return
        states.load_optimizer(self.optimizer, self.model.full_names(), self._full_groups,
                              os.path.join(checkpoint, states.OPTIMIZER))  # fmt: skip
        classes = [g["trainer_group"] for g in self.optimizer.param_groups]
        saved = torch.load(os.path.join(checkpoint, states.SCHEDULER), weights_only=False)
        self.lr_scheduler.load_state_dict(states.scheduler_state(saved, classes, to_trainer=False))

    def _save_rng_state(self, output_dir: str) -> None:
        states.save_rng(os.path.join(output_dir, states.RNG))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            states.load_rng(checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """The checkpoint's HF safetensors, read per rank by a fresh build at this layout (any layout wrote them)."""
        if not os.path.isfile(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME)):
            raise ConfigError(
                f"PipelineTrainer: {resume_from_checkpoint} is no Trainer checkpoint ({TRAINER_STATE_NAME})"
            )
        with torch.device("meta"):  # the first build sharded the given model's own modules: build a fresh one
            fresh = type(self._hf_model)(self._hf_model.config)
        self.pipe = build_pipeline(fresh, self.pipe.mesh, self._pcfg, checkpoint=resume_from_checkpoint,
                                   source_dir=self._source)  # fmt: skip
        self.optimizer, self.lr_scheduler = None, None
        self._set_stages()


class PipelineTrainer(PipelineTrainerMixin, Trainer):
    """transformers.Trainer with the model trained as a pipeline (pp_tp): `PipelineTrainer(model, args, ...,
    parallel=ParallelConfig(pp=2, tp=2))` under torchrun."""
