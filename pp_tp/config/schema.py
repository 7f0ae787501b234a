"""The job's schema: one dataclass per TOML section, and the allowed values and bounds of its keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelShape:
    """The reference Transformer's shape keys of `[model]` (pp_tp.models.reference.ModelArgs is exactly these)."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_dim: int = 176
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm: bool = False
    attn_bias: bool = False
    tie_embeddings: bool = False
    # Mixture of experts (pp_tp/models/reference/moe.py); n_experts = 0 is the dense model.
    n_experts: int = 0
    top_k: int = 2  # experts per token
    n_shared_experts: int = 0  # dense SwiGLU beside the routed experts, n_shared_experts * the expert width wide
    moe_ffn_dim: int | None = None  # one expert's hidden width; None: ffn_dim
    moe_every: int = 1  # layer i is MoE when i % moe_every == moe_every - 1 (2: every second, the first dense)
    router: str = "softmax"  # "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3 without groups) scores
    norm_topk: bool = True  # the k chosen scores renormalized to sum to 1

    @property
    def expert_dim(self) -> int:
        """One expert's hidden width: moe_ffn_dim, or ffn_dim when unset."""
        return self.moe_ffn_dim or self.ffn_dim

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i holds experts in place of the dense MLP."""
        return self.n_experts > 0 and i % self.moe_every == self.moe_every - 1

    @property
    def kv_heads(self) -> int:
        """KV heads: n_kv_heads, or n_heads when unset."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """The per-head width, dim // n_heads."""
        return self.dim // self.n_heads


@dataclass
class ModelConfig(ModelShape):
    """`[model]`: the reference Transformer's shape; `kind` names a registered model kind (pp_tp/config/kinds.py:
    the built-in "reference", "hf_llama", "credit" and "vit", or a plugin's); `hf_path = "DIR"` builds any Hugging
    Face decoder LM from DIR/config.json (its shape keys then come from config.json, and any given beside it must
    agree). A kind's own keys (its `ModelKind.section`, e.g. the CREDIT model's grid) sit in [model] beside these
    and are held, checked by the kind's dataclass, in `options`."""

    kind: str = "reference"
    hf_path: str = ""
    seed: int = 0
    options: Any = field(default=None, metadata={"toml": False})  # the kind's own keys: its section's instance


@dataclass
class ParallelConfig:
    pp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallel: each MoE layer's experts split over ep ranks carved out of dp_shard
    cp: int = 1  # context parallel: each sequence split over cp ranks (head-tail chunks); FSDP over dp_shard x cp
    dp_replicate: int = 1
    dp_shard: int = -1
    schedule: str = "1F1B"
    microbatches: int = 1
    stages_per_rank: int | None = None  # None: from the schedule (schedules.registry.default_stages_per_rank)
    split: str = "even"
    layers_per_stage: list[int] | None = None
    stage_fqns: list[list[str]] | None = None
    split_embed_weight: float = 1.0
    split_head_weight: float = 1.0
    # Either FSDP policy may also be a list with one value per pp rank (what "auto" resolves to).
    fsdp_reshard_after_forward: str | int | list[str | int] = "default"
    # "step": one reduce-scatter per unit per step; "microbatch" (= 1) or k: after every k-th backward of a
    # stage, accumulating sharded; "auto" (with fsdp_reshard_after_forward) picks per stage by memory_budget_gib.
    fsdp_grad_reduce: str | int | list[str | int] = "step"
    grad_accum_dtype: str = "fp32"  # the unsharded gradient accumulation between reductions (bf16 training)
    memory_budget_gib: float | None = None  # per rank; what "auto" fits the policies to
    mixed_precision: str = "bf16"
    # "float64": parameters, activations, stage boundaries, collectives and optimizer state all in float64 (with
    # mixed_precision = "fp32"): the pipelined build compared with the plain float64 model (`pp-tp parity --float64`).
    dtype: str = "float32"
    activation_checkpoint: str = "none"
    compile: bool = False
    compile_backend: str = "inductor"  # torch.compile backend; "aot_eager" compiles fast (CPU tests)
    float8: bool = False
    float8_fsdp_all_gather: bool = False  # FSDP all-gathers float8 weights (needs float8, dp_shard > 1, tp = 1)
    # "auto": "vocab_parallel" when the model ties its embeddings and tp > 1 (the only exact choice), else
    # "replicate"; resolved with the model by preflight.resolve_embedding.
    embedding: str = "auto"
    loss_parallel: bool = False

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        """The ranks the degrees make; with dp_shard = -1 (the rest of the world) the fewest, dp_shard = 1."""
        return self.pp * self.dp_replicate * max(self.dp_shard, 1) * self.cp * self.tp

    @property
    def num_stages(self) -> int:
        """Stages in the pipeline; needs a resolved config (`resolve_parallel` fills stages_per_rank)."""
        return self.pp * self.stages_per_rank


@dataclass
class TrainingConfig:
    steps: int = 10
    batch_size: int = 8
    seq_len: int = 64
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    max_norm: float = 1.0
    seed: int = 0
    log_every: int = 1
    metrics_file: str = ""
    tensorboard_dir: str = ""  # TensorBoard scalars of the logged rows ("" = none); needs the tensorboard package
    comm_timeout_s: float = 300.0
    skip_nonfinite: bool = False  # a non-finite loss or grad norm skips the step (counted) instead of stopping
    loss: str = ""  # "": the language model's token loss; else a name in LOSS_NAMES (models that are not LMs)
    grpo_clip: float = 0.2  # Pipeline.step(..., loss_fn="grpo"): the ratio's clip epsilon
    grpo_kl_coef: float = 0.05  # and the k3 KL term's beta (with extras["ref_logprobs"])


@dataclass
class DataConfig:
    """`[data]`: where the tokens come from. `text` and `synthetic` are byte-level (or `tokenizer`-encoded text);
    `tokens` reads pre-tokenized flat files (`paths` globs, one mixture component each, drawn by `weights`);
    `dataset` tokenizes jsonl / parquet / arrow files or a saved `datasets` directory's `text_field` on the fly.
    `document_mask` restarts position ids after every EOS and keeps attention inside each document. `fields`
    (gridded fields, train/fields.py) and `images` (labelled images, train/images.py) are synthetic data for the
    models that are not language models (their `ModelKind.data`). Plugins add sources (pp_tp/config/kinds.py)."""

    source: str = "synthetic"
    path: str = ""
    paths: list[str] | None = None  # several globs (tokens: one mixture component each); "path" is one
    weights: list[float] | None = None  # per `paths` entry; None: by size (tokens), in order (dataset)
    tokenizer: str = ""  # an HF tokenizer directory (its tokenizer.json); "" = byte-level tokens
    dtype: str = "uint16"  # a .bin token file's element type (.npy files carry their own)
    eos_id: int | None = None  # tokens: the id that ends a document (needed by document_mask)
    text_field: str = "text"  # dataset: the column holding each document's text
    document_mask: bool = False
    prefetch: int = 2  # batches a background thread prepares ahead of the step (0: inline)


@dataclass
class ValidationConfig:
    """`[validation]`: every `every` steps (0 = never), `steps` held-out batches of training.batch_size from
    `path`, or with no path the last `split` fraction of the training text (then held out of training)."""

    every: int = 0
    steps: int = 1
    path: str = ""
    split: float = 0.0


def async_save_allowed() -> bool:
    """Whether DCP's async_save can run here: it needs a process group with a CPU backend for its background
    collectives, which pp_tp makes with gloo (pp_tp.train.checkpoint), so torch must be built with gloo (every
    Linux and macOS wheel, CPU or CUDA, is)."""
    import torch.distributed as dist  # here: the config package imports no torch at module level

    return dist.is_available() and dist.is_gloo_available()


@dataclass
class CheckpointConfig:
    """`[checkpoint]`: DCP checkpoints in `folder` every `interval` steps and at the end, the last `keep` kept.
    `async` (the field `async_`, `async` being a Python keyword; TOML and overrides say `async`): a save copies the
    state and writes it in the background (pp_tp.train.checkpoint); default on where `async_save_allowed`.
    `on_damaged`: what a resume does when the newest checkpoint fails its recorded sizes and checksums
    (pp_tp.train.checkpoint_verify): "error" stops with one line, "previous" resumes from the newest intact one."""

    enable: bool = False
    folder: str = "checkpoints"
    interval: int = 0
    keep: int = 2
    async_: bool = field(default_factory=async_save_allowed)
    on_damaged: str = "error"


@dataclass
class MoEConfig:
    """`[moe]`: load balancing of mixture-of-experts layers (pp_tp/runtime/balancing.py). `aux_loss_coef`: the weight
    of the per-layer, per-microbatch auxiliary loss of softmax routers; `bias_update_rate`: the step of the
    auxiliary-loss-free expert-bias update after each optimizer step (DeepSeek-V3). 0 switches either off."""

    aux_loss_coef: float = 0.0
    bias_update_rate: float = 0.0


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)


# `[training] loss` names (pp_tp.runtime.loss.LOSSES implements them, each summed and divided by the global count).
LOSS_NAMES = ("mse", "l1", "cross_entropy")

# Allowed strings per section and key. A str|int field (fsdp_reshard_after_forward, fsdp_grad_reduce) is
# checked here only when it holds a string.
CHOICES: dict[str, dict[str, tuple[str, ...]]] = {
    # model.kind and data.source: the open registries of pp_tp/config/kinds.py
    "model": {"router": ("softmax", "sigmoid")},
    "training": {"loss": ("", *LOSS_NAMES)},
    "parallel": {
        "split": ("even", "weighted", "balanced", "layers_per_stage", "explicit"),
        "fsdp_reshard_after_forward": ("default", "always", "never", "auto"),
        "fsdp_grad_reduce": ("step", "microbatch", "auto"),
        "grad_accum_dtype": ("fp32", "bf16"),
        "mixed_precision": ("bf16", "fp32"),
        "dtype": ("float32", "float64"),
        "activation_checkpoint": ("none", "full", "selective"),
        "embedding": ("auto", "replicate", "vocab_parallel"),
    },
    "data": {"dtype": ("uint16", "uint32")},
    "checkpoint": {"on_damaged": ("error", "previous")},
}

# (key, lower bound, whether the bound itself is allowed). dp_shard (-1 allowed) has its own check.
BOUNDS: dict[str, tuple[tuple[str, float, bool], ...]] = {
    "model": (
        *(
            (k, 1, True)
            for k in (
                "vocab_size",
                "dim",
                "n_layers",
                "n_heads",
                "n_kv_heads",
                "ffn_dim",
                "max_seq_len",
            )
        ),  # fmt: skip
        *((k, 1, True) for k in ("top_k", "moe_ffn_dim", "moe_every")),
        ("n_experts", 0, True),
        ("n_shared_experts", 0, True),
    ),
    "parallel": (
        ("pp", 1, True),
        ("tp", 1, True),
        ("ep", 1, True),
        ("cp", 1, True),
        ("dp_replicate", 1, True),
        ("microbatches", 1, True),
        ("stages_per_rank", 1, True),
        ("split_embed_weight", 0, True),
        ("split_head_weight", 0, True),
        ("memory_budget_gib", 0, False),
    ),
    "training": (
        ("steps", 1, True),
        ("batch_size", 1, True),
        ("seq_len", 1, True),
        ("lr", 0, False),
        ("warmup_steps", 0, True),
    ),
    "data": (("eos_id", 0, True), ("prefetch", 0, True)),
    "checkpoint": (("interval", 0, True),),
    "validation": (("every", 0, True), ("steps", 1, True), ("split", 0, True)),
    "moe": (("aux_loss_coef", 0, True), ("bias_update_rate", 0, True)),
}

# The split that needs a per-stage list, and that list's key.
SPLIT_ARGS = {"layers_per_stage": "layers_per_stage", "explicit": "stage_fqns"}
