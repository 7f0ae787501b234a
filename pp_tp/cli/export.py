"""`pp-tp export --config F --to OUT [--step N]`: the run's DCP checkpoint (latest, or step N) as an HF directory.

Runs at any world size, 1 process included (`pp-tp export` without torchrun starts a one-rank gloo group): the
model is rebuilt as pp = world size (GPipe, no TP/DP), each rank loads its stages' weights from the DCP
checkpoint (DCP reshards from the training layout) and writes its stages' files (`Pipeline.save_pretrained`).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

import pp_tp
from pp_tp.cli.job import add_job_args, load_job
from pp_tp.config import JobConfig, ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.models.factory import build_model
from pp_tp.parallel.mesh import init_distributed
from pp_tp.train.checkpoint import complete_steps


def add_export_args(parser: argparse.ArgumentParser) -> None:
    add_job_args(parser)
    parser.add_argument("--to", required=True, help="output HF model directory")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")


# The training layout does not matter for export (DCP reshards): the job is read at one rank, layout-free.
_LAYOUT_FREE = [
    "parallel.pp=1", "parallel.tp=1", "parallel.dp_replicate=1", "parallel.dp_shard=1", "parallel.schedule=GPipe",
    "parallel.stages_per_rank=1", "parallel.microbatches=1", "parallel.split=even", "parallel.compile=false",
    "parallel.float8=false", "parallel.fsdp_reshard_after_forward=default", "parallel.fsdp_grad_reduce=step",
]  # fmt: skip


def export_job(args: argparse.Namespace) -> JobConfig:
    """The job's model, data and checkpoint sections, whatever world size it trained at."""
    return load_job(argparse.Namespace(config=args.config, overrides=args.overrides + _LAYOUT_FREE, world_size=1))


def checkpoint_path(cfg: JobConfig, step: int | None) -> str:
    """The DCP checkpoint to export; one line when there is none (or not that step)."""
    steps = complete_steps(cfg.checkpoint.folder)
    if not steps:
        raise ConfigError(f"checkpoint.folder = {cfg.checkpoint.folder!r} has no complete checkpoint; train first")
    if step is not None and step not in steps:
        raise ConfigError(f"--step {step}: no checkpoint step-{step} in {cfg.checkpoint.folder!r}; it has {steps}")
    return os.path.join(cfg.checkpoint.folder, f"step-{steps[-1] if step is None else step}")


def export(cfg: JobConfig, out: str, step: int | None = None, max_shard_size: int | str = "5GB") -> str:
    """Writes the checkpoint as HF safetensors + config.json into `out`; every rank calls it. Returns its path."""
    path = checkpoint_path(cfg, step)
    model = build_model(cfg.model, "meta")
    if not hasattr(getattr(model, "config", None), "save_pretrained"):
        raise ConfigError(
            f"pp-tp export: model.kind = {cfg.model.kind!r} has no Hugging Face format; "
            "use model.hf_path or kind = hf_llama"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    n_layers = layout_for(model).dims(model).n_layers
    if world > n_layers:
        raise ConfigError(f"pp-tp export on {world} ranks needs at least {world} layers (the model has {n_layers})")
    init_distributed(cfg.training.comm_timeout_s)
    pcfg = ParallelConfig(pp=world, dp_shard=1, schedule="GPipe", microbatches=1, mixed_precision="fp32")
    source_dir = cfg.model.hf_path or None  # its generation_config.json goes along
    pipe = pp_tp.build_pipeline(model, pp_tp.build_mesh(pcfg), pcfg, seed=cfg.model.seed, source_dir=source_dir)
    state = {"model": {k: v for part in pipe.model_parts for k, v in get_model_state_dict(part).items()}}
    dcp.load(state, checkpoint_id=path)
    for part in pipe.model_parts:
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
    pipe.save_pretrained(out, max_shard_size=max_shard_size)
    return path


def _single_process_env() -> None:
    """A one-rank world for `pp-tp export` outside torchrun. Port 0: the store binds a free port itself, where a port
    picked and released first can be taken by another process's connection before the store binds it."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")


def main(argv: list[str] | None = None) -> int:
    """Per-rank entry (torchrun), or the single process itself when RANK is unset."""
    parser = argparse.ArgumentParser(prog="python -m pp_tp.cli.export", description=__doc__.splitlines()[0])
    add_export_args(parser)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        _single_process_env()
    try:
        src = export(export_job(args), args.to, args.step, args.max_shard_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if dist.get_rank() == 0:
        print(f"exported {src} -> {args.to}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
