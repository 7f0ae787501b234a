"""The `pp-tp` commands and per-rank entries: job loading, launch, train, check, plan, parity, export."""

from pp_tp.cli.main import main

__all__ = ["main"]
