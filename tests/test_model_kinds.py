"""A model kind's own [model] keys (ModelKind.section): loaded, checked and written back as the kind's alone."""

from __future__ import annotations

from test_config import config_error

from pp_tp.config import config_from_dict, format_config


def test_a_model_kinds_own_keys_belong_to_it_alone():
    """A kind's keys (ModelKind.section) are refused beside another kind, and checked by the kind's own rules."""
    assert "unknown key model.n_classes" in config_error(config_from_dict, {"model": {"n_classes": 3}})
    vit = {"kind": "vit", "n_classes": 3, "patch_size": 5}
    assert "patch_size = 5" in config_error(config_from_dict, {"model": vit}, world_size=1)  # 16 % 5: ViT's rule
    cfg = config_from_dict({"model": {**vit, "patch_size": 8}, "data": {"source": "images"}}, world_size=1)
    g = cfg.model.options
    assert (g.n_classes, g.patch_size, g.channels) == (3, 8, 3) and "n_classes = 3" in format_config(cfg)
