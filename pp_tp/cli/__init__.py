"""The `pp-tp` commands and per-rank entries: job loading, launch, train, check, plan, parity, export."""
