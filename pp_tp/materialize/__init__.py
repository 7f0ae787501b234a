"""One rank's stages made real: prune, parallelize, allocate, then every tensor's value from one named source."""

from pp_tp.materialize.local_stages import build_local_stages, materialize

__all__ = ["build_local_stages", "materialize"]
