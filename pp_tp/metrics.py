"""Per-step training metrics: one line on rank 0's stdout and one JSON object per line in `training.metrics_file`.

MFU needs the device's peak FLOPs, which torch does not expose: a small table of dense bf16 peaks for known
accelerators (vendor datasheets) stands in. On CPU, or in fp32, MFU is left out rather than guessed.
"""

from __future__ import annotations

import json
import os
import resource

import torch

# Dense (not sparse) bf16 tensor-core peaks, FLOP/s per device; longer names are matched first.
PEAK_BF16_FLOPS = {
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "B200": 2250e12,
    "L40S": 362e12,
    "MI300X": 1307e12,
}


def peak_flops(device_name: str) -> float | None:
    """The bf16 peak of a device by its name (torch.cuda.get_device_name), or None when unknown."""
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in device_name:
            return PEAK_BF16_FLOPS[key]
    return None


def peak_memory_gib() -> float:
    """CUDA's max allocated bytes, or on CPU this process's peak resident set (ru_maxrss is KiB on Linux)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsLogger:
    """Formats a step's numbers; only the `writer` rank prints and appends to the JSONL file."""

    def __init__(
        self,
        path: str,
        log_every: int,
        writer: bool,
        flops_per_token: float,
        world_size: int,
        device_peak_flops: float | None,
    ):
        self.path, self.log_every, self.writer = path, log_every, writer
        self.flops_per_token, self.world_size, self.peak = flops_per_token, world_size, device_peak_flops
        if writer and path and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)

    def log(
        self, step: int, last: bool, loss: float, grad_norm: float, lr: float, tokens: int, step_time_s: float
    ) -> dict:
        """The step's row (returned on every rank); printed and written on log steps by the writer rank."""
        tps = tokens / step_time_s
        row = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s": tps,
            "step_time_s": step_time_s,
            "peak_mem_gib": peak_memory_gib(),
        }
        if self.peak:
            row["mfu"] = self.flops_per_token * tps / (self.world_size * self.peak)
        if self.writer and (last or step % self.log_every == 0):
            mfu = f" | mfu {100 * row['mfu']:.1f}%" if "mfu" in row else ""
            print(
                f"step {step:>6} | loss {loss:.4f} | grad_norm {grad_norm:.3f} | lr {lr:.2e} | "
                f"tok/s {tps:,.0f} | {step_time_s:.3f} s | peak {row['peak_mem_gib']:.2f} GiB{mfu}",
                flush=True,
            )
            if self.path:
                with open(self.path, "a") as f:
                    f.write(json.dumps(row) + "\n")
        return row
