"""pp_tp: pipeline- and tensor-parallel Transformer training on PyTorch's own distributed stack."""

from pp_tp import models  # noqa: F401  (registers the built-in model layouts)
from pp_tp.build import build_pipeline
from pp_tp.config import ConfigError, JobConfig, MoEConfig, ParallelConfig, load_config
from pp_tp.extend.plugins import load_plugins
from pp_tp.parallel.mesh import build_mesh
from pp_tp.runtime.built import BuildOptions
from pp_tp.runtime.pipeline import Pipeline

load_plugins()  # last: a plugin may import pp_tp's public names

__all__ = [
    "BuildOptions",
    "ConfigError",
    "JobConfig",
    "MoEConfig",
    "ParallelConfig",
    "Pipeline",
    "build_mesh",
    "build_pipeline",
    "load_config",
]
