"""The extension points, in one public module: model layouts, schedules and tensor-parallel styles.

A model pp_tp does not know gets a `ModelLayout` (where its embedding, blocks, norm and head live and how to
call a block); a schedule a `ScheduleSpec`; a TP style name a `TPStyle` record (its torch ParallelStyle factory and
what pp_tp's checks and dropout streams must know about it). Register them here, or ship them as
`pp_tp.model_layouts` / `pp_tp.schedules` entry points (see pp_tp.plugins). docs/design.md explains each.
"""

from pp_tp.layout import ModelDims, ModelLayout, blocks_layout, layout_for, register_layout
from pp_tp.parallel.tp_styles import TPStyle, register_tp_style
from pp_tp.schedules.registry import ScheduleSpec, register_schedule
from pp_tp.seeded_init import default_init_std, seeded_value

__all__ = [
    "ModelDims",
    "ModelLayout",
    "ScheduleSpec",
    "TPStyle",
    "blocks_layout",
    "default_init_std",
    "layout_for",
    "register_layout",
    "register_schedule",
    "register_tp_style",
    "seeded_value",
]
