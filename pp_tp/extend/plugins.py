"""Entry-point discovery: third-party packages add model layouts, schedules, model kinds and data sources without
editing pp_tp.

A package declares, in its pyproject.toml::

    [project.entry-points."pp_tp.model_layouts"]
    mymodel = "mypkg.pp:LAYOUT"        # a pp_tp.extend.ModelLayout
    [project.entry-points."pp_tp.schedules"]
    MySchedule = "mypkg.pp:SCHEDULE"   # a pp_tp.extend.ScheduleSpec
    [project.entry-points."pp_tp.model_kinds"]
    mymodel = "mypkg.pp:KIND"          # a pp_tp.extend.ModelKind: TOML [model] kind = "mymodel"
    [project.entry-points."pp_tp.data_sources"]
    mydata = "mypkg.pp:SOURCE"         # a pp_tp.extend.DataSource: TOML [data] source = "mydata"

`import pp_tp` loads them once, after its own registries exist; the registries never import this module.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from pp_tp.config.kinds import register_data_source, register_model_kind
from pp_tp.layout import register_layout
from pp_tp.schedules.registry import register_schedule

_loaded = False


def load_plugins() -> None:
    """Registers every installed plugin once per process."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for ep in entry_points(group="pp_tp.model_layouts"):
        register_layout(ep.load())
    for ep in entry_points(group="pp_tp.schedules"):
        register_schedule(ep.load())
    for ep in entry_points(group="pp_tp.model_kinds"):
        register_model_kind(ep.name, ep.load())
    for ep in entry_points(group="pp_tp.data_sources"):
        register_data_source(ep.name, ep.load())
