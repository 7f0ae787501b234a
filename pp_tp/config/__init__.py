"""The job config: schema, TOML loading with overrides, and the checks that need no model or process group."""

from pp_tp.config.loading import config_from_dict, config_to_dict, format_config, load_config
from pp_tp.config.schema import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainingConfig,
)
from pp_tp.config.validate import check_ep, resolve_dp_shard, resolve_parallel, validate
from pp_tp.errors import ConfigError

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "JobConfig",
    "ModelConfig",
    "MoEConfig",
    "ParallelConfig",
    "TrainingConfig",
    "check_ep",
    "config_from_dict",
    "config_to_dict",
    "format_config",
    "load_config",
    "resolve_dp_shard",
    "resolve_parallel",
    "validate",
]
