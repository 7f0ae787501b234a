"""Acceptance, decided before any collective: every rule that needs the model (rules.py), then one verdict agreed
by every rank (verdict.py)."""

from pp_tp.preflight.rules import (
    Preflight,
    PreflightInputs,
    check_model_shape,
    check_seq_len,
    preflight,
    resolve_embedding,
)

__all__ = ["Preflight", "PreflightInputs", "check_model_shape", "check_seq_len", "preflight", "resolve_embedding"]
