"""Parity: the same steps on the one-process model (fp32 and float64) and on its Pipeline, judged against float64."""

from pp_tp.parity.lockstep import (
    FACTOR,
    FLOOR_ULPS,
    PipelineRun,
    ReferenceRun,
    StepDiff,
    dp_share,
    floor_for,
    judge,
    lockstep,
    mean_token_loss,
    rel_err,
)

__all__ = [
    "FACTOR",
    "FLOOR_ULPS",
    "PipelineRun",
    "ReferenceRun",
    "StepDiff",
    "dp_share",
    "floor_for",
    "judge",
    "lockstep",
    "mean_token_loss",
    "rel_err",
]
