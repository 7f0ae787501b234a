"""Per-step training metrics: one line on rank 0's stdout and one JSON object per line in `training.metrics_file`
(and TensorBoard scalars in `training.tensorboard_dir`).

MFU needs the model's FLOPs per token (`flops_per_token`, read off its layout and modules) and the device's peak
FLOPs, which torch does not expose: a small table of dense bf16 peaks for known accelerators (vendor datasheets)
stands in. On CPU, or in fp32, MFU is left out rather than guessed.
"""

from __future__ import annotations

import json
import os
import resource

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.layout import ModelLayout
from pp_tp.parallel.experts import experts_modules
from pp_tp.runtime.routing_stats import imbalance
from pp_tp.split import cost
from pp_tp.train.tensorboard import TensorBoard


def flops_per_token(model: nn.Module, layout: ModelLayout, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token of the model a layout describes, read off its own blocks: 6 x
    every weight a token multiplies (an experts module's at top_k of n_experts: only the chosen experts run), causal
    attention's 6 x seq_len x heads x head_dim per block, and the head with its cross-entropy. Not a dense formula:
    an MoE, MLA or a model with other widths counts what it holds (meta tensors suffice)."""
    dims, spec = layout.dims(model), layout.experts_spec
    active = (spec.top_k or spec.n_experts) / spec.n_experts if spec is not None else 1.0
    total = 0.0
    for block in model.get_submodule(layout.blocks).children():
        experts = {id(p) for _, m in experts_modules(block, layout) for p in m.parameters()}
        for p in block.parameters():
            if p.dim() >= 2:
                total += 6.0 * p.numel() * (active if id(p) in experts else 1.0)
        total += 6.0 * seq_len * dims.n_heads * (dims.head_dim or dims.dim // dims.n_heads)
    return total + cost.head_flops(dims) + cost.embed_flops(dims)


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


def peak_memory_label() -> str:
    """What `peak_memory_gib` measures, as the step log names it."""
    return "CUDA max allocated" if torch.cuda.is_available() else "process max RSS"


def peak_memory_gib() -> float:
    """CUDA's max allocated bytes, or on CPU this process's peak resident set (ru_maxrss is KiB on Linux)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _hms(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}h{m % 60:02d}m{s:02d}s" if m >= 60 else f"{m}m{s:02d}s"


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
        total_steps: int = 0,
        tensorboard_dir: str = "",
    ):
        self.path, self.log_every, self.writer = path, log_every, writer
        self.tensorboard = TensorBoard(tensorboard_dir) if writer and tensorboard_dir else None
        self.total_steps, self._times = total_steps, []
        self.flops_per_token, self.world_size, self.peak = flops_per_token, world_size, device_peak_flops
        if writer and path and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)

    def record(self, row: dict) -> None:
        """Appends one non-step row (the layout, a skipped step) to the JSONL file on the writer rank."""
        if self.writer and self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def _eta_s(self, step: int, step_time_s: float) -> float:
        """Remaining steps times the mean step time so far (the first step, with its warm-up, left out)."""
        self._times.append(step_time_s)
        recent = self._times[1:] or self._times
        return max(self.total_steps - step, 0) * sum(recent) / len(recent)

    def log(
        self,
        step: int,
        last: bool,
        loss: float,
        grad_norm: float,
        lr: float,
        tokens: int,
        step_time_s: float,
        extra: dict | None = None,
    ) -> dict:
        """The step's row (returned on every rank); printed and written on log steps by the writer rank.

        `extra`: more figures for the row (val_loss, skipped_steps, data_s: the step's wait for its batch); with
        `total_steps`, an ETA too."""
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
        row.update(extra or {})
        if self.total_steps:
            row["eta_s"] = self._eta_s(step, step_time_s)
        if self.writer and (last or step % self.log_every == 0):
            mfu = f" | mfu {100 * row['mfu']:.1f}%" if "mfu" in row else ""
            mfu += f" | val_loss {row['val_loss']:.4f}" if "val_loss" in row else ""
            mfu += f" | skipped {row['skipped_steps']}" if row.get("skipped_steps") else ""
            mfu += f" | moe imbalance {row['moe_imbalance']:.2f}" if "moe_imbalance" in row else ""
            mfu += f" | aux_loss {row['aux_loss']:.4f}" if row.get("aux_loss") else ""
            mfu += f" | data {1000 * row['data_s']:.1f} ms" if "data_s" in row else ""
            mfu += f" | {step}/{self.total_steps} eta {_hms(row['eta_s'])}" if "eta_s" in row else ""
            print(
                f"step {step:>6} | loss {loss:.4f} | grad_norm {grad_norm:.3f} | lr {lr:.2e} | "
                f"tok/s {tps:,.0f} | {step_time_s:.3f} s | {peak_memory_label()} {row['peak_mem_gib']:.2f} GiB{mfu}",
                flush=True,
            )
            if self.path:
                with open(self.path, "a") as f:
                    f.write(json.dumps(row) + "\n")
            if self.tensorboard is not None:
                self.tensorboard.write(row)
        return row


def moe_imbalance(tokens_per_expert: dict[str, torch.Tensor], mesh: DeviceMesh) -> dict:
    """The step's tokens-per-expert imbalance (max / mean) of every MoE layer of the model, gathered over the pp
    ranks (a collective: every rank calls it each step), and the worst of them."""
    parts: list = [None] * mesh["pp"].size()
    dist.all_gather_object(parts, imbalance(tokens_per_expert), group=mesh.get_group("pp"))
    per_layer = {k: v for part in parts for k, v in part.items()}
    return {"moe_imbalance": max(per_layer.values(), default=1.0), "moe_imbalance_per_layer": per_layer}
