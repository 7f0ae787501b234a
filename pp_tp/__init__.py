"""pp_tp: pipeline- and tensor-parallel Transformer training on PyTorch's own distributed stack."""

from pp_tp.build import build_pipeline
from pp_tp.config import ConfigError, JobConfig, ParallelConfig, load_config
from pp_tp.mesh import build_mesh
from pp_tp.schedules.pipeline import Pipeline

__all__ = ["ConfigError", "JobConfig", "ParallelConfig", "Pipeline", "build_mesh", "build_pipeline", "load_config"]
