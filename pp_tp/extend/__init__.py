"""The extension points, in one public module: model layouts, schedules, tensor-parallel styles, model kinds and
data sources.

A model pp_tp does not know gets a `ModelLayout` (its blocks and how to call one, and two `Edge`s: what the first
stage runs before them and the last after them); a schedule a `ScheduleSpec`; a TP style name a `TPStyle` record (its
torch ParallelStyle factory and what pp_tp's checks and dropout streams must know about it); a TOML `model.kind` a
`ModelKind` (how to build it from [model], and the data a model that is not a language model trains on); a
`data.source` a `DataSource` (its loader).
Register them here, or ship them as `pp_tp.model_layouts` / `pp_tp.schedules` / `pp_tp.model_kinds` /
`pp_tp.data_sources` entry points (see pp_tp.extend.plugins). docs/design.md explains each.
"""

from pp_tp.base.seeded_init import default_init_std, seeded_value
from pp_tp.config.kinds import DataSource, ModelKind, register_data_source, register_model_kind
from pp_tp.layout import (
    Edge,
    ExpertsSpec,
    ModelDims,
    ModelLayout,
    PackedSwiGLU,
    blocks_layout,
    in_order,
    layout_for,
    register_layout,
)
from pp_tp.parallel.tp_styles import TPStyle, register_tp_style
from pp_tp.schedules.registry import ScheduleSpec, register_schedule

__all__ = [
    "DataSource",
    "Edge",
    "ExpertsSpec",
    "ModelDims",
    "ModelKind",
    "ModelLayout",
    "PackedSwiGLU",
    "ScheduleSpec",
    "TPStyle",
    "blocks_layout",
    "default_init_std",
    "in_order",
    "layout_for",
    "register_data_source",
    "register_layout",
    "register_model_kind",
    "register_schedule",
    "register_tp_style",
    "seeded_value",
]
