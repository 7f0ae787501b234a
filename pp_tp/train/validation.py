"""`[validation]`: every `every` steps, the mean loss over `steps` fixed held-out batches, forward only
through the pipeline schedule (`Pipeline.evaluate`). The batches are the same at every evaluation and
for every layout (a fixed order, shared out over DP ranks like the training batches)."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from pp_tp.config import JobConfig
from pp_tp.parallel.mesh import dp_rank, dp_size
from pp_tp.runtime.pipeline import Pipeline
from pp_tp.train.loader import ShardedBatches
from pp_tp.train.text_tokens import TokenWindows, eos_id, load_tokenizer, validation_windows


class Validator:
    """Builds the held-out windows once (before any collective: errors are one line); `run` evaluates."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.windows: TokenWindows | None = validation_windows(cfg) if cfg.validation.every else None
        d = cfg.data  # held-out text is tokenized like the training text: documents masked alike
        masked = self.windows is not None and d.document_mask and d.tokenizer
        self.eos = eos_id(d.tokenizer, load_tokenizer(d.tokenizer)) if masked else None

    def due(self, step: int, last: bool) -> bool:
        every = self.cfg.validation.every
        return bool(every) and (step % every == 0 or last)

    def run(self, pipe: Pipeline, mesh: DeviceMesh) -> float:
        """The mean of the held-out batches' global mean token losses; every rank calls it."""
        t = self.cfg.training
        batches = ShardedBatches([self.windows], t.batch_size, dp_rank(mesh), dp_size(mesh), t.seed, eos=self.eos)
        losses = [float(pipe.evaluate(*batches.next())) for _ in range(self.cfg.validation.steps)]
        return sum(losses) / len(losses)
