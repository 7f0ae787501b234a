"""What `build_pipeline` hands the `Pipeline`: the caller's options as one value, and this rank's built stages.

An option travels whole: from `build_pipeline`'s keywords (or `options=`) into `BuildOptions`, carried by
`BuiltStages`, kept by `Pipeline.options` and read where it is used, never copied field by field on the way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.config import MoEConfig, ParallelConfig
from pp_tp.config.fsdp_policy import FsdpPolicy
from pp_tp.runtime.boundary import BoundaryShapes, InferredShapes
from pp_tp.runtime.loss import SumLoss
from pp_tp.split.plan import StagePlan
from pp_tp.stages.stage_module import StageModule
from pp_tp.stages.tied import TiedWeights


@dataclass(frozen=True)
class BuildOptions:
    """Everything `build_pipeline` takes beyond the model, the mesh and the parallel config (its keywords, same names
    and defaults), frozen so that no step of the build or the run can change what the caller asked for.

    `seed`: parameter values of a meta model; `state_dict`: values keyed by FQN instead; `seq_len`: checked against
    the model before the build; `checkpoint`: an HF model directory whose safetensors fill the stages, each rank
    reading only its own slices; `source_dir`: the HF directory whose generation_config.json `save_pretrained` keeps
    (default: `checkpoint`); `loss_fn` (a callable with reduction="sum", or "mse", "l1", "cross_entropy") over the
    global `loss_normalizer`: runtime/loss.py:SumLoss, for `step(inputs, targets)`; `rng_seed`: the dropout streams'
    seed (default: `seed`; pp_tp/parallel/rng.py); `moe`: MoE load balancing (runtime/balancing.py; default: none);
    `document_mask`: steps will pass packed documents' position ids (`data.document_mask`), so a layout that cannot
    mask them is refused at the build, not at the first step.
    `grpo_clip`, `grpo_kl_coef`: `step(..., loss_fn="grpo")`'s epsilon and beta (runtime/policy_loss.py)."""

    seed: int = 0
    state_dict: Mapping[str, torch.Tensor] | None = None
    seq_len: int | None = None
    checkpoint: str | None = None
    source_dir: str | None = None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | str | None = None
    loss_normalizer: str = "elements"
    rng_seed: int | None = None
    moe: MoEConfig | None = None
    document_mask: bool = False
    grpo_clip: float = 0.2
    grpo_kl_coef: float = 0.05

    @classmethod
    def of(cls, options: BuildOptions | None, keywords: dict[str, Any]) -> BuildOptions:
        """`options` (default: every default) with `keywords` replacing its fields: build_pipeline's two spellings
        make one value; an unknown keyword is a TypeError naming it, as a wrong keyword argument always is."""
        return replace(options if options is not None else cls(), **keywords)

    @property
    def hf_source_dir(self) -> str | None:
        """The directory `save_pretrained` copies generation_config.json from: `source_dir`, else `checkpoint`."""
        return self.source_dir if self.source_dir is not None else self.checkpoint

    @property
    def dropout_seed(self) -> int:
        """The seed of the stages' dropout streams: `rng_seed`, else `seed`."""
        return self.seed if self.rng_seed is None else self.rng_seed

    @property
    def balancing(self) -> MoEConfig:
        """The MoE load balancing in force: `moe`, else none (both switches at 0)."""
        return self.moe if self.moe is not None else MoEConfig()


@dataclass(frozen=True)
class BuiltStages:
    """Everything `build_pipeline` made for one rank, handed to `Pipeline` whole.

    `fsdp`: this pp rank's FSDP policy; `shapes(microbatch shape, dtype)`: the boundary tensors for a microbatch of
    inputs (checked against the model); `grad_factor`: what FSDP divides gradients by, undone in the loss; `options`:
    what the caller asked for, whole; `loss`: the caller's summed loss made from `options` (None: token
    cross-entropy); `tied`: tied weights held by several stages; `hf_config`: the config.json `save_pretrained`
    writes; `checkpoint_casts`: dtype conversions made while loading an HF checkpoint (for the log)."""

    stages: list[StageModule]
    plan: StagePlan
    mesh: DeviceMesh
    pcfg: ParallelConfig
    fsdp: FsdpPolicy
    device: torch.device
    shapes: Callable[[tuple[int, ...], torch.dtype], BoundaryShapes | InferredShapes]
    grad_factor: int
    options: BuildOptions = field(default_factory=BuildOptions)
    loss: SumLoss | None = None
    tp_loss_mesh: DeviceMesh | None = None
    tied: TiedWeights | None = None
    hf_config: Any = None
    checkpoint_casts: Counter = field(default_factory=Counter)
