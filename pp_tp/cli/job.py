"""A whole job checked before anything starts: the config's own rules, then the model's (pp_tp.preflight).

Every CLI command runs `check_job` before it spawns a rank or builds a mesh, and `build_pipeline` runs
the same `preflight`, so `pp-tp check` refuses exactly what a run would refuse, with the same line.
"""

from __future__ import annotations

import argparse
import dataclasses

from pp_tp.config import JobConfig, load_config, validate
from pp_tp.hf_checkpoint import has_weights, open_checked
from pp_tp.models.factory import build_model, resolve_model_config
from pp_tp.parallel.mesh import device_type
from pp_tp.preflight import Preflight, PreflightInputs, preflight
from pp_tp.train.sources import make_source
from pp_tp.train.tensorboard import check_tensorboard


def check_job(cfg: JobConfig, world_size: int | None = None, data: bool = True) -> tuple[JobConfig, Preflight]:
    """The validated, resolved config and what the model checks found; raises ConfigError on the first refusal.

    `data`: also open the training data source (`pp-tp parity` feeds its own random batches)."""
    cfg = validate(dataclasses.replace(cfg, model=resolve_model_config(cfg.model)), world_size)
    model = build_model(cfg.model, "meta")
    checked = preflight(model, cfg.parallel, PreflightInputs.of_job(cfg, device_type()))
    cfg = dataclasses.replace(cfg, parallel=checked.parallel)
    if cfg.model.hf_path and has_weights(cfg.model.hf_path):
        open_checked(cfg.model.hf_path, model)  # every header and size the job will load, as build_pipeline does
    if data:
        make_source(cfg)  # the data source opens and fits the model
    check_tensorboard(cfg.training.tensorboard_dir)
    return cfg, checked


def add_job_args(parser: argparse.ArgumentParser) -> None:
    """--config, --world-size and trailing `section.key=value` overrides: every command that reads a job."""
    parser.add_argument("--config", required=True, help="TOML job file")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="number of ranks to check against (default: $WORLD_SIZE, else the product of the degrees)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="override a TOML value, e.g. parallel.tp=2 parallel.schedule=GPipe",
    )


def load_job(args: argparse.Namespace) -> JobConfig:
    """The config named by `add_job_args`' arguments, validated on its own (no model checks); with
    `model.hf_path`, its shape keys are config.json's."""
    cfg = load_config(args.config, args.overrides, args.world_size)
    return dataclasses.replace(cfg, model=resolve_model_config(cfg.model))
