"""The rows a PipelineTrainer step trains on: the one-process Trainer's loader, this DP rank's share of each batch,
and one optimizer step's micro-batches merged into the `[rows, seq]` input ids and aligned labels `Pipeline.step`
takes.

Every rank reads the loader Trainer builds on one process (accelerate prepares it as for one process), with
`per_device_*_batch_size x dp` rows per batch, and keeps rows `[r * b, (r + 1) * b)` as DP rank r: the global step
trains on the rows a one-process Trainer with `per_device_train_batch_size x dp` reads, in its order, as DDP
Trainer does at dp processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from accelerate.data_loader import prepare_data_loader

from pp_tp.errors import ConfigError

IGNORE = -100


@contextlib.contextmanager
def one_process_loaders(accelerator: Any) -> Iterator[None]:
    """Within the block `accelerator.prepare(loader)` prepares a loader as on one process (no sharding over the
    world: the DP share is taken per batch by `dp_share`), with the accelerator's own data-loader settings."""

    def prepare(loader: Any) -> Any:
        return prepare_data_loader(
            loader,
            None,
            num_processes=1,
            process_index=0,
            split_batches=accelerator.split_batches,
            put_on_device=False,
            rng_types=accelerator.rng_types.copy(),
            dispatch_batches=False,
            even_batches=accelerator.even_batches,
            use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed,
            non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader,
        )

    accelerator.prepare = prepare
    try:
        yield
    finally:
        del accelerator.prepare


def dp_share(batch: dict[str, Any], dp: int, rank: int) -> dict[str, Any]:
    """DP rank `rank`'s rows of a global batch: every tensor with the batch's rows is cut in `dp` equal parts."""
    rows = batch["input_ids"].shape[0]
    if rows % dp:
        raise ConfigError(
            f"PipelineTrainer: a batch of {rows} rows does not split over dp = {dp}; set dataloader_drop_last=True "
            f"or give a dataset whose size is a multiple of the batch"
        )
    b = rows // dp
    return {
        k: v[rank * b : (rank + 1) * b] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == rows else v
        for k, v in batch.items()
    }


def _right_padded(mask: torch.Tensor) -> bool:
    """Whether every row's attention mask is ones then zeros: causal attention then gives the real tokens the same
    outputs without the mask, and their labels are what the loss reads."""
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def _aligned(batch: dict[str, Any]) -> torch.Tensor:
    """Labels aligned with the inputs (position t predicts label t): `shift_labels` as given, else `labels` shifted
    left by one as the causal LM loss does (the last position ignored)."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    if "labels" not in batch:
        raise ConfigError("PipelineTrainer: a batch has no `labels`; use a collator that makes them")
    labels = batch["labels"]
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)


def _pad(t: torch.Tensor, seq: int, value: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, seq - t.shape[1]), value=value)


def merge_rows(batches: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One optimizer step's micro-batches as (input_ids, aligned labels, position_ids or None), `[rows, seq]`, each
    padded on the right to the longest: padding is never attended to by a real token and its labels are ignored.
    Position ids are kept only when they are not 0..seq-1 on every row (packed documents)."""
    for batch in batches:
        unknown = sorted(set(batch) - {"input_ids", "labels", "shift_labels", "attention_mask", "position_ids"})
        if unknown:
            raise ConfigError(f"PipelineTrainer: the batch key {unknown[0]!r} has no pipeline input; drop it")
        mask = batch.get("attention_mask")
        if mask is not None and not _right_padded(mask):
            raise ConfigError("PipelineTrainer: a batch is padded on the left; pad on the right (padding_side='right')")
    seq = max(b["input_ids"].shape[1] for b in batches)
    ids = torch.cat([_pad(b["input_ids"], seq, 0) for b in batches])
    labels = torch.cat([_pad(_aligned(b), seq, IGNORE) for b in batches])
    positions = None
    if any("position_ids" in b for b in batches):
        pos = [b.get("position_ids", torch.arange(b["input_ids"].shape[1]).expand_as(b["input_ids"])) for b in batches]
        positions = torch.cat([_pad(p, seq, 0) for p in pos])
        if torch.equal(positions, torch.arange(seq).expand_as(positions)):
            positions = None
    return ids, labels, positions
