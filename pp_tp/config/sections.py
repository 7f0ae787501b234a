"""Cross-key checks of the `[validation]` section (kept apart from validate.py, which is near its size limit)."""

from __future__ import annotations

import os

from pp_tp.config.schema import DataConfig, ValidationConfig
from pp_tp.errors import ConfigError


def check_validation(v: ValidationConfig, data: DataConfig) -> ValidationConfig:
    """Held-out text exists, or a split of the training text is asked for; one line naming the key otherwise."""
    if not v.every:
        return v
    if v.path and not os.path.isfile(v.path):
        raise ConfigError(f"validation.path = {v.path!r} is not an existing file; give a held-out text file")
    if v.path and v.split:
        raise ConfigError("validation.path and validation.split both choose the held-out text; keep one of them")
    if not v.path and not 0 < v.split < 1:
        raise ConfigError(
            f"validation.every = {v.every} needs held-out text: set validation.path, or validation.split "
            "in (0, 1) to hold out the end of the training text"
        )
    if not v.path and data.source != "text":
        raise ConfigError(
            f"validation.split = {v.split} splits the training text, but data.source = {data.source!r}; "
            'set data.source = "text" or give validation.path'
        )
    return v
