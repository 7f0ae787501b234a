"""Every private torch name pp_tp uses, behind one door (tested on torch 2.13).

Each entry says why pp_tp needs it and which public API would replace it. When torch changes one of
these, this file is the only place to mend; nothing else in pp_tp imports a private torch name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# The planner's shape-only forward. Public replacement: torch._subclasses has none yet.
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401

# An in-flight functional collective and its wait: a TP all-reduce can still be pending when a stage
# returns, and a stage boundary must carry a finished plain tensor. Public: torch.distributed's
# functional collectives API, still under a private module name.
# The all-to-all with autograd (its backward is the reverse all-to-all) that expert parallel sends tokens with.
# Public: none; torch.distributed.all_to_all_single is not differentiable.
from torch.distributed._functional_collectives import (  # noqa: F401
    AsyncCollectiveTensor,
    all_to_all_single_autograd,  # noqa: F401
    wait_tensor,
)

# Sets a process group's timeout: torchtitan 0.3.0's Trainer calls it as torch.distributed.set_timeout, which torch
# 2.13 does not export (pp_tp.integrations.torchtitan_compat). Public replacement: torch.distributed.set_timeout.
from torch.distributed.distributed_c10d import _set_pg_timeout as set_pg_timeout  # noqa: F401

# Pipelining actions and the runtime schedule: needed to load CSV schedules and to rewrite the
# UNSHARD/RESHARD actions (pytorch#164756). Public replacement: none yet (torch exports only the
# schedule classes).
from torch.distributed.pipelining.schedules import (  # noqa: F401  (re-exported)
    _Action as Action,
)
from torch.distributed.pipelining.schedules import (
    _PipelineScheduleRuntime as PipelineScheduleRuntime,
)

# A DTensor placement for a dim split in parts that are each sharded (packed gate/up experts, TP per part).
# Public: none yet (FSDP2 uses it for the same layout).
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: F401

# Tells tensor subclasses (DTensor & co.) from plain tensors. Public replacement: none.
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass  # noqa: F401

# Flattens collective arguments in the comm ledger and a layer's outputs (models/hf/threaded.py). Public:
# torch.utils.pytree (experimental).
from torch.utils._pytree import tree_flatten  # noqa: F401


def flatten_mesh_dims(mesh: Any, dims: tuple[str, ...], name: str) -> None:
    """Registers `dims` of `mesh` as one dim `name` (expert parallel keeps "dp_shard" = ("dp_shard_mod_ep", "ep")).
    Public replacement: none yet (torchtitan uses the same DeviceMesh._flatten)."""
    mesh[dims]._flatten(name)


def forget_sharding_specs() -> None:
    """Empties DTensor's sharding-propagation caches (torch has no public call for it)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def swap_parameters(module: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Puts plain tensors where `module`'s parameters are (an experts module reads its local shards); returns what
    was there, for the way back. Public replacement: torch.func.functional_call, which would call the module
    itself (whose forward is the dispatch calling this)."""
    saved = dict(module._parameters)
    module._parameters.update(tensors)
    return saved


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (activation checkpointing recomputes forwards there).
    Public replacement: none."""
    return torch._C._current_graph_task_id() != -1


def foreach_mul_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Scales many tensors in one call: clipping scales the local shards of every gradient at once (DTensor
    dispatch would cost a call per mesh and placements). Public replacement: torch.nn.utils.clip_grads_with_norm_,
    which takes parameters and reads their (DTensor) .grad."""
    torch._foreach_mul_(tensors, factor)


def load_csv_schedule(schedule: PipelineScheduleRuntime, path: str) -> None:
    """Reads a torch action CSV into a runtime schedule. Public replacement: none (torch's own tests use it)."""
    schedule._load_csv(path)


def compute_order(cls: type, stages: Any, microbatches: int) -> dict[int, list]:
    """A torch schedule class's `pipeline_order` (per-rank compute actions), without the lowering to
    communication actions its constructor also runs (`_prepare_schedule_with_comms`: only a runtime step reads it,
    and it leaves `pipeline_order` as it is). Public replacement: the constructor, which lowers too."""
    from unittest import mock

    with mock.patch.object(cls, "_prepare_schedule_with_comms", lambda *a, **k: None):
        return cls(stages, microbatches).pipeline_order


def fake_store() -> Any:
    """A store for torch's `fake` process-group backend (registers the backend on import).
    Public replacement: none; it lives in torch.testing._internal."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def resolve_process_group(arg: Any) -> Any:
    """A process group from a group name (functional collectives pass names). Public replacement: none."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(arg)


def process_group_type() -> type:
    """The C++ ProcessGroup class, to recognise group arguments. Public: torch.distributed.ProcessGroup."""
    from torch._C._distributed_c10d import ProcessGroup

    return ProcessGroup


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard without an autograd view (to_local() would make one). Public: to_local()."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def child_modules(module: nn.Module) -> dict[str, nn.Module]:
    """A module's direct children by name, including None entries. Public: named_children() skips None."""
    return module._modules


def is_persistent_buffer(module: nn.Module, name: str) -> bool:
    """Whether a buffer goes into state_dict. Public replacement: none (register_buffer's flag is not exposed)."""
    return name not in module._non_persistent_buffers_set


def is_compiled(module: nn.Module) -> bool:
    """Whether Module.compile() ran on it. Public replacement: none."""
    return getattr(module, "_compiled_call_impl", None) is not None


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def copy_forward_hooks(old: nn.Module, new: nn.Module) -> None:
    """Moves forward hooks onto a module that replaces `old` (torchao swaps Linear objects after TP
    registered hooks on them). Public replacement: none (hooks are only removable by handle)."""
    for hooks in _HOOK_DICTS:
        getattr(new, hooks).update(getattr(old, hooks))


Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


def schedule_stages(schedule: Any) -> list[Any]:
    """The PipelineStage objects a schedule drives (multi-stage or single-stage schedule).
    Public replacement: none (schedules keep them as `_stages` / `_stage`)."""
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def patch_schedule_timing(schedule: Any, wrap_loss: Wrap, wrap_p2p_wait: Wrap) -> Callable[[], None]:
    """Wraps a schedule's loss computation and torch's p2p wait for the timeline; returns the undo.
    Public replacement: none (the schedules expose no hooks)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    schedule._maybe_compute_loss = wrap_loss(schedule._maybe_compute_loss)
    wait = torch_schedules._wait_batch_p2p
    torch_schedules._wait_batch_p2p = wrap_p2p_wait(wait)

    def undo() -> None:
        torch_schedules._wait_batch_p2p = wait
        del schedule.__dict__["_maybe_compute_loss"]

    return undo


def stage_backward(stage_output: Any, output_grads: Any, input_values: Any) -> Any:
    """torch's own full backward of one pipeline stage (what PipelineStage runs for a "full" backward), so a
    subclass can run it with FSDP gradient sync on. Public replacement: none (pipelining._backward)."""
    from torch.distributed.pipelining._backward import stage_backward as backward

    return backward(stage_output, output_grads, input_values)


def fsdp_reduce_grads_now(module: nn.Module) -> None:
    """Runs FSDP2's post-backward on every unit under `module` now (reduce-scatter, accumulate sharded), as
    torch's PipelineStage.perform_reduce_grad does at a step's end but without finalizing the step; the
    caller sets the flags. Public replacement: none (FSDP2 reduces only from autograd hooks)."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)
    for unit in state._state_ctx.all_states:
        for group in unit._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def local_shape_and_offset(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's block of a DTensor: (local shape, offset in the global tensor); a plain tensor is all of it.
    DCP uses the same function to plan its reads. Public replacement: none yet (torch.distributed.tensor._utils)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(t, DTensor):
        return tuple(t.shape), (0,) * t.dim()
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(shape), tuple(offset)


def local_index_runs(t: torch.Tensor) -> list[list[tuple[int, int]]] | None:
    """For a DTensor with a `_StridedShard` placement (a packed weight split per part: its block is not one box of
    the global tensor, which `local_shape_and_offset` would wrongly give), the global (start, length) index runs its
    local shard holds along each dim, in local order; None for any other tensor. Each dim's runs come from sharding
    an arange of that dim with the same placements, locally (src_data_rank=None: no communication)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    if not isinstance(t, DTensor) or not any(isinstance(p, StridedShard) for p in t.placements):
        return None
    runs = []
    for d, n in enumerate(t.shape):
        along = [
            (StridedShard(0, split_factor=p.split_factor) if isinstance(p, StridedShard) else Shard(0))
            if isinstance(p, (Shard, StridedShard)) and p.dim == d
            else Replicate()
            for p in t.placements
        ]
        runs.append(_runs(distribute_tensor(torch.arange(n), t.device_mesh, along, src_data_rank=None).to_local()))
    return runs


@functools.lru_cache(maxsize=1024)
def block_runs(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Any, ...], coordinate: tuple[int, ...]
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per dim, the global (start, length) index runs of the block that the rank at `coordinate` of a DTensor's mesh
    holds, in its local order: each Shard / _StridedShard splits the indices as `distribute_tensor` splits the tensor
    (its placement's `_split_tensor`). Public replacement: none (`compute_local_shape_and_global_offset` gives the
    caller's own block only, and as one box, which a _StridedShard block may not be)."""
    from torch.distributed.tensor import Shard

    runs = []
    for d, n in enumerate(shape):
        index = torch.arange(n)
        for axis, p in enumerate(placements):
            if isinstance(p, (Shard, StridedShard)) and p.dim % len(shape) == d:
                along = StridedShard(0, split_factor=p.split_factor) if isinstance(p, StridedShard) else Shard(0)
                index = along._split_tensor(index, mesh_shape[axis], with_padding=False)[0][coordinate[axis]]
        runs.append(tuple(_runs(index)))
    return tuple(runs)


def _runs(index: torch.Tensor) -> list[tuple[int, int]]:
    """A 1-D index tensor as (start, length) runs of consecutive indices, in its order."""
    out: list[tuple[int, int]] = []
    for i in index.tolist():
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def per_part_replicated(t: Any) -> Any:
    """`t` with every per-part split (`_StridedShard`) replaced by Replicate over its mesh dim (an all-gather there),
    other placements kept; anything else returned as it is. DCP stores a rank's shard as one box of the global
    tensor, which a per-part split is not (dcp.save refuses it: "overlapping chunks")."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor) or not any(isinstance(p, StridedShard) for p in t.placements):
        return t
    return t.redistribute(t.device_mesh, [Replicate() if isinstance(p, StridedShard) else p for p in t.placements])


def storage_id(storage: torch.UntypedStorage) -> int:
    """One number per storage, the same through every tensor and view of it, so saved activations count once per
    storage. Public replacement: none (`data_ptr()` is 0 for every meta and fake storage, which the planner walks)."""
    return storage._cdata


def tensor_version(t: torch.Tensor) -> int:
    """A tensor's in-place modification counter (autograd's). Public replacement: none."""
    return t._version


# Attention blocks that return their log-sum-exp, and the kernels' backward run with a merged output and
# log-sum-exp: context parallel's exact blockwise attention (pp_tp/parallel/cp_attention_blocks.py), as torch's ring
# attention merges its blocks. Public replacement: none (F.scaled_dot_product_attention returns no log-sum-exp).
def sdpa_lse_kernel(q: torch.Tensor, heads_kv: int) -> str | None:
    """The fused kernel the blocks run on for queries like `q` against `heads_kv` key heads: "cpu" (flash for CPU:
    any float dtype, grouped heads), "cuda" (flash: fp16/bf16, head dim a multiple of 8 up to 256, equal heads, as
    flash's own checks ask), None where neither takes them (callers keep the masked path)."""
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return "cpu"
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        if q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 and q.shape[1] == heads_kv:
            return "cuda"
    return None


def sdpa_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(out, logsumexp [B, H, L], what the CUDA backward needs beside them) of one attention block, dropout off."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return out, lse, (cq, ck, mq, mk, seed, offset)


def sdpa_backward_with_lse(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float | None,
    state: tuple,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's kernel backward given the (merged) output and log-sum-exp of its rows: grads of q, k, v."""
    aten = torch.ops.aten
    if not state:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    cq, ck, mq, mk, seed, offset = state
    return aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset, scale=scale
    )[:3]
