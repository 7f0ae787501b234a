"""Training checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, LR schedule, data loader state
(samples consumed and each mixture component's count, or each packed row's epoch, document and offset), RNG.

Model and optimizer entries are keyed by the full model's FQNs (torch's `get_model_state_dict` /
`get_optimizer_state_dict` with flattened optimizer state, per model part), and DCP reshards DTensors on
load, so a checkpoint written at one layout (pp2 x tp2) loads at another (pp4, pp1 x tp2, pp1).

A checkpoint is written into `.step-K.tmp` and renamed to `step-K` only once every rank's shard and DCP's
metadata are on disk: the rename is the completion marker, and `latest_checkpoint` sees only renamed ones, so a
crash mid-save leaves the last complete checkpoint untouched. Every rank writes into `checkpoint.folder`, so on
several nodes it must be a shared file system.

`checkpoint.async` (the default where DCP's async_save can run: torch built with gloo, see
`config.schema.async_save_allowed`): `save` copies the state (DCP's staging, one more copy of the rank's state in
host memory while the write runs) and returns; DCP writes it in a background thread whose collectives run on a
gloo group of their own, and rank 0 renames it once DCP's metadata is written (after every rank's shard). The next
save, the final one and `close` wait for it first.
"""

from __future__ import annotations

import io
import os
import re
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from pp_tp.base._torch import per_part_replicated
from pp_tp.base.per_world import once_per_world
from pp_tp.config import CheckpointConfig
from pp_tp.errors import ConfigError
from pp_tp.parallel.rng import StageStream
from pp_tp.train.checkpoint_verify import damage, record_checksums
from pp_tp.train.prefetch import Prefetcher

_FINAL = re.compile(r"^step-(\d+)$")
_TMP = re.compile(r"^\.step-(\d+)\.tmp$")
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


def _rng_blob(streams: Sequence[StageStream]) -> bytes:
    """Every rank's RNG states (its global generators and its stages' dropout streams), gathered: one object identical
    on all ranks, as DCP needs for a replicated entry."""
    mine = {"cpu": torch.get_rng_state(), "streams": [s.state for s in streams]}
    if torch.cuda.is_available():
        mine["cuda"] = torch.cuda.get_rng_state()
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    buf = io.BytesIO()
    torch.save(states, buf)
    return buf.getvalue()


def _restore_rng(blob: bytes, streams: Sequence[StageStream]) -> None:
    """Restores this rank's RNG when the world size matches; at another layout the streams do not correspond."""
    states = torch.load(io.BytesIO(blob), weights_only=True)
    if len(states) == dist.get_world_size():
        mine = states[dist.get_rank()]
        torch.set_rng_state(mine["cpu"])
        for stream, state in zip(streams, mine.get("streams", [])):
            stream.state = state
        if "cuda" in mine and torch.cuda.is_available():
            torch.cuda.set_rng_state(mine["cuda"])


def complete_steps(folder: str) -> list[int]:
    """The steps of the complete checkpoints in `folder`, oldest first."""
    if not os.path.isdir(folder):
        return []
    return sorted(
        int(m.group(1))
        for name in os.listdir(folder)
        if (m := _FINAL.match(name)) and os.path.isfile(os.path.join(folder, name, ".metadata"))
    )


def latest_checkpoint(folder: str) -> str | None:
    """The newest complete checkpoint in `folder`, or None."""
    steps = complete_steps(folder)
    return os.path.join(folder, f"step-{steps[-1]}") if steps else None


def resume_checkpoint(ccfg: CheckpointConfig) -> tuple[str | None, str]:
    """(the checkpoint to resume from, the line saying it fell back): the newest complete one once its files pass
    their recorded sizes and checksums; when they do not, one ConfigError line naming the file and the newest intact
    checkpoint, or with `checkpoint.on_damaged = "previous"` that intact one. Every rank gets the same answer."""
    steps = complete_steps(ccfg.folder) if ccfg.enable else []
    if not steps:
        return None, ""
    newest = os.path.join(ccfg.folder, f"step-{steps[-1]}")
    problem = damage(newest)
    if problem is None:
        return newest, ""
    older = (os.path.join(ccfg.folder, f"step-{s}") for s in reversed(steps[:-1]))
    intact = next((path for path in older if damage(path) is None), None)
    line = f"checkpoint {newest} is damaged: {problem}; the newest intact checkpoint is {intact or 'none'}"
    if intact is None:
        raise ConfigError(f"{line}; delete {newest} to start over, or restore the file")
    if ccfg.on_damaged == "error":
        raise ConfigError(f'{line}; set checkpoint.on_damaged = "previous" to resume from it, or restore the file')
    return intact, f'{line}: resuming from it (checkpoint.on_damaged = "previous")'


_PER_GROUP = ("base_lrs", "_last_lr")  # the LR scheduler's per-param-group lists


def _stored(state: dict) -> dict:
    """The state as DCP stores it: model and optimizer tensors split per part (`_StridedShard`, a fused weight's or
    packed experts' matching rows) replicated over that mesh dim, since DCP's chunks are boxes; layout-free."""
    with torch.no_grad():
        return {**state, **{k: {n: per_part_replicated(t) for n, t in state[k].items()} for k in ("model", "optim")}}


def _one_group(state: dict) -> dict:
    """The schedulers step together and every param group shares one LR, so one group's state stands for all: a
    part's group count follows its layout (DTensor and plain parameters, trainer.build_optimizers), the checkpoint's
    must not."""
    return {k: v[:1] if k in _PER_GROUP else v for k, v in state.items()}


def _per_group(state: dict, groups: int) -> dict:
    return {k: v[:1] * groups if k in _PER_GROUP else v for k, v in state.items()}


def _save_group(timeout_s: float) -> dist.ProcessGroup:
    """The gloo group of the background writes: DCP's async_save gathers plans and results from a thread, and on a
    group of its own those collectives never interleave with the training's (one per default group: every rank makes
    it, a collective, at its first async Checkpointer, so long-lived worlds do not pile up groups)."""
    return once_per_world(
        ("checkpoint saves",), lambda: dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    )


def _then(written: Future, publish: Callable[[], None]) -> Future:
    """A future done once `written` is and `publish` ran after it (in the writer's thread): a done-callback alone
    runs after `result()` waiters wake, which could then see the checkpoint not yet renamed."""
    done: Future = Future()

    def finish(f: Future) -> None:
        try:
            f.result()
            publish()
            done.set_result(None)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(e)

    written.add_done_callback(finish)
    return done


class Checkpointer:
    """Saves every `checkpoint.interval` steps and at the end; resumes from the newest complete checkpoint."""

    def __init__(
        self,
        ccfg: CheckpointConfig,
        model_parts: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        schedulers: list[torch.optim.lr_scheduler.LRScheduler],
        loader: Prefetcher,
        rng_streams: Sequence[StageStream] = (),
        comm_timeout_s: float = 300.0,
    ):
        self.cfg = ccfg
        self.parts, self.optimizers, self.schedulers, self.loader = model_parts, optimizers, schedulers, loader
        self.rng_streams = rng_streams  # the pipeline's dropout streams (Pipeline.rng_streams)
        self.group = _save_group(comm_timeout_s) if ccfg.enable and ccfg.async_ else None
        self.pending: Future | None = None  # the background save in flight

    def _state(self, step: int) -> dict:
        model: dict = {}
        optim: dict = {}
        for part, opt in zip(self.parts, self.optimizers):
            model.update(get_model_state_dict(part))
            optim.update(get_optimizer_state_dict(part, opt, options=_OPTIM))
        return {
            "model": model,
            "optim": optim,
            "lr_scheduler": _one_group(self.schedulers[0].state_dict()),
            "data": self.loader.state_dict(),
            "rng": _rng_blob(self.rng_streams),
            "step": step,
        }

    def load(self, path: str) -> int:
        """Restores everything from `path` into the live objects; returns the step it was saved at."""
        state = self._state(0)
        stored = _stored(state)
        split = [(s, k) for s in ("model", "optim") for k, t in stored[s].items() if t is not state[s][k]]
        dcp.load(stored, checkpoint_id=path)
        with torch.no_grad():  # per-part splits back to their placements (local slicing)
            for section, key in split:
                t = stored[section][key]
                stored[section][key] = t.redistribute(t.device_mesh, state[section][key].placements)
        state = stored  # DCP replaced the non-tensor entries (step, data, rng) in the dict it loaded
        for part, opt in zip(self.parts, self.optimizers):
            # The dict holds every local part's keys; DCP already refused any key missing from the checkpoint.
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
            set_optimizer_state_dict(part, opt, state["optim"], options=_OPTIM)
        for sched in self.schedulers:
            sched.load_state_dict(_per_group(state["lr_scheduler"], len(sched.optimizer.param_groups)))
        self.loader.load_state_dict(state["data"])
        _restore_rng(state["rng"], self.rng_streams)
        return int(state["step"])

    def save(self, step: int) -> str:
        """Writes step `step` as `.step-K.tmp`, renamed to `step-K` once complete, and drops the oldest checkpoints
        beyond `checkpoint.keep`. With checkpoint.async it returns once the state is copied (the previous save
        finished first); the write and the rename go on in the background."""
        self.wait()
        final = os.path.join(self.cfg.folder, f"step-{step}")
        tmp = os.path.join(self.cfg.folder, f".step-{step}.tmp")
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crashed save of the same step
            os.makedirs(tmp)
        dist.barrier()
        state = _stored(self._state(step))
        if self.group is None:
            dcp.save(state, checkpoint_id=tmp)  # returns on every rank once the metadata is written
            self._publish(tmp, final, None)
            dist.barrier()
        else:
            written = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group)
            self.pending = _then(written, lambda: self._publish(tmp, final, self.group))
        return final

    def wait(self) -> None:
        """Until the background save in flight (if any) is complete and renamed, on every rank; raises its error."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()
            dist.barrier()  # rank 0 renamed it before any rank goes on

    def close(self) -> None:
        """On the way out after an error: lets the save in flight end (completed, or failed with a dead peer: never
        renamed, so no checkpoint), without the barrier, which the peers may not reach."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.exception()

    def maybe_save(self, step: int, last: bool) -> None:
        """Saves when due; the final save of a run is complete when this returns."""
        if self.cfg.enable and (last or (self.cfg.interval and step % self.cfg.interval == 0)):
            self.save(step)
            if last:
                self.wait()

    def _publish(self, tmp: str, final: str, group: dist.ProcessGroup | None) -> None:
        """Every rank records its files' sizes and checksums, then rank 0 marks the written checkpoint complete (the
        rename) and prunes; on the writer's thread (and the save group) when async."""
        record_checksums(tmp, dist.get_rank(), dist.get_world_size())
        dist.barrier(group=group)
        if dist.get_rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            self._prune()

    def _prune(self) -> None:
        """Drops the checkpoints beyond `checkpoint.keep` and the leftovers of crashed saves of earlier steps (a save
        starts only after the previous one ended, so an older temporary directory is no save in flight)."""
        names = os.listdir(self.cfg.folder)
        steps = sorted(int(m.group(1)) for name in names if (m := _FINAL.match(name)))
        dropped = [f"step-{old}" for old in steps[: -self.cfg.keep]] if self.cfg.keep > 0 else []
        dropped += [name for name in names if (m := _TMP.match(name)) and int(m.group(1)) < steps[-1]]
        for name in dropped:
            shutil.rmtree(os.path.join(self.cfg.folder, name), ignore_errors=True)
