"""Every Hugging Face decoder-only causal-LM family, through pp_tp on its defaults: exact, refused or wrong.

    python bench/family_sweep.py                                  # all families, table to stdout
    python bench/family_sweep.py --families llama qwen3_next      # some model types
    python bench/family_sweep.py --out docs/family_sweep.md       # the table to a file too
    python bench/family_sweep.py --float64 --families llama ...   # with the float64 column (family_float64.py)

For each decoder-only `model_type` of the installed transformers' causal-LM mapping, with a declared
`base_model_pp_plan` or not (pp_tp then finds the structure from the forward; encoder-decoder and encoder-only types,
those in the seq2seq or masked-LM mappings, are listed as out of scope): its default config shrunk by pp_tp's own
`small_config`, seeded random weights (norm weights near 1, all-zero persistent float buffers such as router biases
stirred), fp32. On 4 gloo ranks (one world for every family) the model's own forward + backward on an 8 x 16 batch
is the reference; `build_pipeline` with default options (pp2 x tp2, 1F1B, 2 microbatches; a dense family that
declares no TP plan too, its pairs inferred and proven by pp_tp or run whole on every TP rank; MoE families pp2 x
dp_shard2 x ep2, or `--moe-layout dp_shard` / `tp`) runs one `Pipeline.step` on the
same weights and batch. The loss and every full gradient are judged as pp_tp.parity judges a step (its `judge`):
against a float64 run of the plain model, the plain fp32 run being the yardstick, so no tolerance is tuned to one
machine. Each scores err(pipeline, f64) / (FACTOR * err(plain fp32, f64) + floor) and passes at a score <= 1; the
table's "loss score" and "worst grad score" columns are the worst scores over the ranks. Verdicts: exact (loss and
every full gradient pass, persistent buffers equal the plain fp32 run's, parameters covered), refused (the same
one-line ConfigError on every rank), wrong (anything else), skipped (the reference itself could not be built or run,
in fp32 or float64: not pp_tp's doing; the float64 run comes after pp_tp's build, so a refusal still reads as one).
Dropout a default config turns on is set to 0 (the note says so): two builds draw different random masks. Exit code
1 when any family is wrong.
"""

from __future__ import annotations

import argparse
import os
import site
import sys
import time
from collections.abc import Sequence

from common import World
from family_catalog import MOE_LAYOUTS, class_name, default_config, families, repair_note
from family_run import family_case, judged_step, references, step_reference
from family_verdict import Row, classify, markdown
from harness import RankError

# The sweep in four files, one job each: family_catalog (which families, configs, layouts), family_run (one family
# on one rank), family_verdict (rows and the table), this one (the world and the command line).
__all__ = ["Row", "classify", "default_config", "judged_step", "references", "repair_note", "step_reference", "sweep"]

WORLD = 4

CASE_TIMEOUT_S = 300.0


def sweep(names: Sequence[str], world: World, moe_layout: str = "ep", float64: bool = False) -> list[Row]:
    """Every family in `names` on the `WORLD`-rank `world`, one case each; after a rank crash or an exception
    inside pp_tp the world restarts, so later families start from clean process groups. `float64`: the float64
    column too (bench/family_float64.py)."""
    rows = []
    for i, name in enumerate(names):
        start = time.perf_counter()
        try:
            # A world started by another caller (the tests' session world) has no bench/ on its ranks' path.
            world.run(site.addsitedir, os.path.dirname(os.path.abspath(__file__)))
            row = classify(name, world.run(family_case, name, moe_layout, float64, timeout=CASE_TIMEOUT_S))
        except RankError as e:  # the world is gone already; the next run starts a fresh one
            row = Row(name, class_name(name), "", "wrong", note=f"rank crash: {str(e).splitlines()[0]}")
        row.note = "; ".join(filter(None, (row.note, repair_note(name))))
        if row.verdict == "wrong" and row.loss_score is None:  # an exception: a collective may have stopped midway
            world.close()  # so the next family starts on fresh process groups
        rows.append(row)
        print(f"[{i + 1}/{len(names)}] {name}: {row.verdict} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", metavar="MODEL_TYPE", help="model types (default: every family)")
    parser.add_argument("--moe-layout", choices=sorted(MOE_LAYOUTS), default="ep", help="how MoE families run")
    parser.add_argument("--out", help="also write the Markdown table to this file")
    parser.add_argument("--float64", action="store_true", help="add the float64 column (bench/family_float64.py)")
    a = parser.parse_args()
    names = a.families or families()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # the ranks inherit it: progress lines stay readable
    world = World(WORLD)
    try:
        rows = sweep(names, world, a.moe_layout, a.float64)
    finally:
        world.close()
    text = markdown(rows)
    print(text, end="")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    sys.exit(1 if any(r.verdict == "wrong" for r in rows) else 0)


if __name__ == "__main__":
    main()
