"""`training.tensorboard_dir`: the step rows also as TensorBoard scalars (torch's SummaryWriter, the `tensorboard`
package), beside the JSONL, on the rank that writes the metrics."""

from __future__ import annotations

from pp_tp.errors import ConfigError

# Row key -> TensorBoard tag.
SCALARS = {
    "loss": "train/loss",
    "val_loss": "val/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "step_time_s": "perf/step_time_s",
    "data_s": "perf/data_s",
    "peak_mem_gib": "memory/peak_gib",
}


def check_tensorboard(logdir: str) -> None:
    """A TensorBoard directory needs the package: one line before any rank starts, not a failure on rank 0 alone."""
    if not logdir:
        return
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"training.tensorboard_dir = {logdir!r} needs the tensorboard package: pip install tensorboard "
            '(or the "data" extra), or set training.tensorboard_dir = ""'
        ) from None


class TensorBoard:
    """Writes each logged row's scalars under its step; flushed every row so a live TensorBoard sees them."""

    def __init__(self, logdir: str):
        from torch.utils.tensorboard import SummaryWriter

        check_tensorboard(logdir)
        self.writer = SummaryWriter(logdir)

    def write(self, row: dict) -> None:
        for key, tag in SCALARS.items():
            if key in row:
                self.writer.add_scalar(tag, row[key], row["step"])
        self.writer.flush()
