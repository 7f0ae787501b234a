"""The structural guarantee that a Hugging Face model is never trained silently wrong.

Before anything is built, the generic layout's composed forward (embedding -> blocks as the layout calls
them -> norm -> head, with the model-level extras; built on meta and materialized as a pipelined rank does,
so restored buffers are checked too) runs against the model's own `forward` on a small copy
of its config: 2+ layers covering every attention and MLP type, tiny widths kept self-consistent, a sequence
longer than any sliding window, CPU, fp32, fixed seed, every parameter and persistent buffer copied. A family
whose forward does anything the layout does not know is refused in one line naming its class. The verdict is
deterministic (every rank reaches the same one) and kept in the family's record (record.py) and on disk, so it costs
seconds once per machine. The small copy is small.py's; the model it is compared with is the record's seeded copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pp_tp.base.forward import without_cache
from pp_tp.errors import ConfigError
from pp_tp.layout import ModelLayout
from pp_tp.materialize import materialize
from pp_tp.models.hf.record import Record, record_of, seeded_values
from pp_tp.models.hf.small import small_config
from pp_tp.split.plan import StageSpec
from pp_tp.stages.stage_module import StageModule

SEQ = 12  # longer than the sliding window set below, so window masks really cut
TOLERANCE = 1e-5


def _materialized_stage(
    cls: type, small, reference: nn.Module, compose: Callable[[nn.Module], ModelLayout]
) -> StageModule:
    """The whole small model as one stage, built the way pipelined ranks build theirs (`materialize`: on meta,
    allocated, buffers from the layout, then parameters and persistent buffers from `reference` by FQN)."""
    with torch.device("meta"):
        meta = cls(small)
    layout = compose(meta)
    keys = layout.block_keys(meta)
    fqns = [*layout.first.modules, *(f"{layout.blocks}.{k}" for k in keys), *layout.last.modules]
    stage = StageModule(meta, layout, StageSpec(0, 0, True, keys, True, fqns))
    values = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    materialize(stage, meta, torch.device("cpu"), values=values)
    return stage.to(torch.float32).eval()


@torch.no_grad()
def _verdict(record: Record, compose: Callable[[nn.Module], ModelLayout]) -> str | None:
    """None when the composition equals the model's forward on the small config, else why not. Deterministic:
    fixed seeds (the caller's RNG state untouched), every value copied, so every rank reaches the same verdict."""
    try:
        model = record.copy()  # the record's seeded small copy, untouched
        seeded_values(model, 1, None, zero_buffers=True)
        stage = _materialized_stage(record.cls, record.small, model, compose)
        ids = torch.randint(0, record.small.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want = model(input_ids=ids, **without_cache(model)).logits
            got = stage(ids)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the small copy is a reason to refuse
        return f"its 2-layer copy could not run through pp_tp's layout ({type(e).__name__}: {str(e)[:120]})"
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    return None if err <= TOLERANCE else f"its own forward differs from pp_tp's composition by {err:.1e} (relative)"


def self_check(model: nn.Module, compose: Callable[[nn.Module], ModelLayout]) -> None:
    """Refuses `model` in one line when its family's forward is not what `compose` describes (the verdict kept in
    the family's record)."""
    try:
        small_config(model.config)
    except Exception as e:  # noqa: BLE001 - a config that cannot be shrunk cannot be checked: refused
        raise ConfigError(
            f"model {type(model).__name__}: its config cannot be shrunk for pp_tp's self-check "
            f"({type(e).__name__}: {str(e)[:120]}); register a layout for it: pp_tp.extend.register_layout"
        ) from None
    try:
        record = record_of(model)
        why = record.derived("self_check", lambda: _verdict(record, compose), on_disk=True)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a small copy that cannot be built is a reason to refuse
        why = f"its 2-layer copy could not run through pp_tp's layout ({type(e).__name__}: {str(e)[:120]})"
    if why is not None:
        raise ConfigError(
            f"model {type(model).__name__}: {why}; pp_tp refuses it rather than train it differently "
            "(register a layout for it: pp_tp.extend.register_layout)"
        )
