"""TRL's supervised fine-tuning through the pipeline: `PipelineSFTTrainer(model, SFTConfig(...), ...,
parallel=...)` is TRL's `SFTTrainer` (its dataset formatting, chat templates, completion-only labels, packing and
padding-free batches) with PipelineTrainer's seams (hf_trainer.py): each optimizer step is one `Pipeline.step`.

TRL's per-token metrics (entropy, token accuracy) read the logits, which stay on the last stage: they are not logged.
What cannot run under a pipeline is refused by name at construction (peft_config, loss_type other than "nll",
activation_offloading, use_liger_kernel, compute_metrics).
"""

from __future__ import annotations

from trl import SFTTrainer

from pp_tp.integrations.hf_trainer import PipelineTrainerMixin

__all__ = ["PipelineSFTTrainer"]


class PipelineSFTTrainer(PipelineTrainerMixin, SFTTrainer):
    """trl.SFTTrainer with the model trained as a pipeline (pp_tp), launched under torchrun."""
