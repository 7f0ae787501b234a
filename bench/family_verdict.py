"""The sweep's verdicts: one row per family from every rank's answer, and the Markdown table of them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from family_catalog import class_name, out_of_scope
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from pp_tp.parity import FACTOR, FLOOR_ULPS
from pp_tp.parity.float64 import BOUND
from pp_tp.parity.lockstep import Judged


@dataclass
class Row:
    """One family's line of the table."""

    model_type: str
    family: str
    layout: str
    verdict: str  # exact | refused | wrong | skipped
    loss_score: float | None = None  # the pipelined loss's score against the float64 truth (passes at <= 1)
    grad_score: float | None = None  # the worst full gradient's score, over every rank
    mixers: str = ""
    note: str = ""
    f64_err: float | None = None  # with --float64: the float64 build's worst relative error against float64 plain
    f64_name: str = ""  # and its tensor


def classify(model_type: str, per_rank: Sequence[dict[str, Any]]) -> Row:
    """One verdict from every rank's answer: exact and refused need all ranks to agree, everything else is wrong."""
    first = per_rank[0]
    row = Row(model_type, first.get("family") or class_name(model_type), first.get("layout", ""), "wrong")
    kinds = [next((k for k in ("skipped", "refused", "error") if k in r), "ran") for r in per_rank]
    if set(kinds) == {"skipped"} and len({r["skipped"] for r in per_rank}) == 1:
        row.verdict, row.note = "skipped", first["skipped"]
        return row
    if set(kinds) == {"refused"} and len({r["refused"] for r in per_rank}) == 1:
        row.verdict, row.note = "refused", first["refused"][:100]
        return row
    if set(kinds) != {"ran"}:
        rank, r = next((i, r) for i, r in enumerate(per_rank) if kinds[i] != "ran")
        why = r.get("error") or r.get("refused") or r.get("skipped")
        row.note = f"ranks answered {kinds}; rank {rank}: {why}" if len(set(kinds)) > 1 else f"rank {rank}: {why}"
        return row
    loss = max((r["loss"] for r in per_rank), key=lambda j: j.score)
    grads = max((r["grads"] for r in per_rank), key=lambda j: j.score)
    row.loss_score, row.grad_score = loss.score, grads.score
    missing = sorted(set(first["params"]) - {k for r in per_rank for k in r["covered"]})
    bad_buffers = sorted({b for r in per_rank for b in r["bad_buffers"]})
    problems = [_off("loss", loss)] if not loss.passed else []
    problems += [_off(f"worst grad {grads.name}", grads)] if not grads.passed else []
    if bad_buffers:
        problems.append(f"buffers differ: {', '.join(bad_buffers[:3])}" + (" ..." if len(bad_buffers) > 3 else ""))
    if missing:
        problems.append(f"params on no rank: {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))
    context = [f"{first['attn']} attention"] if first["attn"] != "sdpa" else []
    context += [f"dropout set to 0 for the comparison: {', '.join(first['dropout'])}"] if first["dropout"] else []
    noise = first.get("noise")
    context += (
        [f"random draws beyond dropout set to 0 for the comparison (built with them on): {', '.join(noise)}"]
        if noise
        else []
    )
    row.mixers = first["mixers"]
    row.verdict = "wrong" if problems else "exact"
    row.note = "; ".join(problems + context + _float64(row, per_rank))
    return row


def _float64(row: Row, per_rank: Sequence[dict[str, Any]]) -> list[str]:
    """The float64 column (bench/family_float64.py) into `row`: the worst error over the ranks (NaN worst) and its
    tensor; the note's words where it could not run or exceeds BOUND (the fp32 verdict above stays the verdict)."""
    notes = sorted({r["f64_note"] for r in per_rank if "f64_note" in r})
    ran = [r for r in per_rank if "f64_err" in r]
    if ran:
        worst = max(ran, key=lambda r: float("inf") if r["f64_err"] != r["f64_err"] else r["f64_err"])
        row.f64_err, row.f64_name = worst["f64_err"], worst["f64_name"]
        if not row.f64_err <= BOUND:
            notes.append(f"float64 {row.f64_err:.1e} off float64 plain on {row.f64_name}")
    return notes


def _off(what: str, j: Judged) -> str:
    """A failed score in words: how far the pipelined run is from float64, against the plain fp32 run's distance."""
    return f"{what} {j.score:.3g}x its bound: {j.pipe:.1e} off float64 (plain fp32 {j.plain:.1e})"


def markdown(rows: Sequence[Row]) -> str:
    """The table, then one line of counts per verdict."""
    fmt = lambda x: "" if x is None else f"{x:.2g}"  # noqa: E731
    lines = [
        f"Made by `python bench/family_sweep.py --out docs/family_sweep.md` (torch {torch.__version__}, "
        f"transformers {transformers.__version__}, 4 gloo ranks). Loss score, worst grad score: the pipelined "
        f"value's distance to a float64 run of the plain model over ({FACTOR:g} x the plain fp32 run's distance + "
        f"{FLOOR_ULPS} fp32 ulps), worst over the ranks; exact needs both <= 1 (pp_tp.parity's verdict).",
        "",
        "| family | model type | layout | verdict | loss score | worst grad score | TP of mixers | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    f64 = any(r.f64_err is not None for r in rows)  # the float64 column, where --float64 ran
    if f64:
        lines[-2:] = [lines[-2][: -len(" note |")] + " float64 err | note |", "|---" * 9 + "|"]
    for r in rows:
        note = r.note.replace("|", "\\|").replace("\n", " ")
        col = f"| {'' if r.f64_err is None else f'{r.f64_err:.1e}'} " if f64 else ""
        lines.append(
            f"| {r.family} | {r.model_type} | {r.layout} | {r.verdict} | {fmt(r.loss_score)} | {fmt(r.grad_score)} "
            f"| {r.mixers} {col}| {note} |"
        )
    counts = Counter(r.verdict for r in rows)
    lines.append("")
    lines.append(", ".join(f"{counts[v]} {v}" for v in ("exact", "refused", "wrong", "skipped")))
    scope: dict[str, list[str]] = {}
    for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if (why := out_of_scope(t)) is not None:
            scope.setdefault(why, []).append(t)
    lines += [""] + [f"Out of scope ({why}, {len(ts)}): {', '.join(ts)}." for why, ts in scope.items()]
    return "\n".join(lines) + "\n"
