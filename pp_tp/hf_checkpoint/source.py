"""An HF model directory's safetensors, indexed by key from the file headers, and checked against a model.

Only headers are read here (safetensors files are memory-mapped; `get_slice` touches just the bytes of the
slice asked for). Every check runs on every rank before any collective, so a bad checkpoint is one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from dataclasses import dataclass

import torch
from torch import nn

from pp_tp.base.tensors import persistent_buffers
from pp_tp.errors import ConfigError
from pp_tp.hf_checkpoint.conversion import build_views
from pp_tp.hf_checkpoint.quantized import pair_scales, quantization, read_dequantized
from pp_tp.hf_checkpoint.views import Leaf, View, walk_box
from pp_tp.hf_checkpoint.views import leaves as leaves_of
from pp_tp.stages.stage_module import canonical_names

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

# safetensors dtype names -> torch dtypes: floating point (weights, float buffers) and integers (int buffers).
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def has_weights(path: str) -> bool:
    """Whether `path` holds HF safetensors weights (one file, or an index of shards)."""
    return os.path.isfile(os.path.join(path, SINGLE)) or os.path.isfile(os.path.join(path, INDEX))


@dataclass(frozen=True)
class Entry:
    """Where one tensor lives and what it is, from its file's header."""

    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _files(path: str) -> list[str]:
    """The safetensors files of `path`: the index's shards, or model.safetensors."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"checkpoint {index} has no weight_map; write it with save_pretrained")
        return sorted(set(weight_map.values()))
    if os.path.isfile(os.path.join(path, SINGLE)):
        return [SINGLE]
    raise ConfigError(f"checkpoint {path!r} has no {SINGLE} or {INDEX}; give a Hugging Face model directory")


def _check_file(file: str) -> None:
    """Refuses, in one line naming `file`, a safetensors file shorter or longer than its header says, or whose
    header does not parse: safetensors' own error on such a file is a traceback on every rank."""
    size = os.path.getsize(file)
    damaged = f"checkpoint {file} is damaged ({{}}); copy it again"
    with open(file, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or n > size - 8:
            raise ConfigError(damaged.format(f"{size} bytes, shorter than its header"))
        try:
            header = json.loads(f.read(n))
            data = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise ConfigError(damaged.format(f"its header does not parse: {type(e).__name__}")) from None
    if size != 8 + n + data:
        raise ConfigError(damaged.format(f"{size:,} bytes; its header describes {8 + n + data:,}: truncated?"))


class HFSource:
    """The tensors of an HF directory: `entries` by on-disk key (from the file headers), `views` by model key once
    checked against a model (`open_checked`); `read` returns one block of a model tensor, cast explicitly."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        self.entries: dict[str, Entry] = {}
        self.views: dict[str, View] = {}
        self.quantization = quantization(path)
        for name in _files(path):
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                raise ConfigError(f"checkpoint {path!r}: the index names {name}, which is missing; copy it there")
            _check_file(file)
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    dtype = _DTYPES.get(sl.get_dtype())
                    if dtype is None:
                        raise ConfigError(
                            f"checkpoint {file}: {key!r} has dtype {sl.get_dtype()}, which pp_tp cannot read; "
                            "store weights as F32, BF16, F16, block FP8 or MXFP4 (integer buffers as I64, I32, I16, "
                            "I8, U8 or BOOL)"
                        )
                    self.entries[key] = Entry(file, tuple(sl.get_shape()), dtype)

    def read(self, key: str, offset: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The block of model tensor `key` at `offset` of size `shape`, in `dtype` (`read_into` a new tensor)."""
        out = torch.empty(shape, dtype=dtype)
        self.read_into(key, offset, out)
        return out

    def read_into(self, key: str, offset: tuple[int, ...], out: torch.Tensor) -> None:
        """Fills `out` with the block of model tensor `key` at `offset`, converted to out's dtype (the one explicit
        cast; block FP8 is dequantized here), reading only the on-disk bytes inside the block.

        Files are mapped for this one read: pages of a mapping stay in the resident set while it is open, so
        keeping files open would count every block read so far twice (mapped and copied).
        """
        with _OpenFiles() as files:
            walk_box(self.views[key], offset, out, lambda *a: self._leaf(files, *a))

    def _leaf(self, files, leaf: Leaf, offset: tuple[int, ...], out: torch.Tensor) -> None:
        shape = tuple(out.shape)
        if leaf.method is None:
            block = files.block(leaf.file, leaf.key, offset, shape)
        else:
            block = read_dequantized(leaf, offset, shape, out.dtype, files.block)
        out.copy_(block.to(out.dtype))


class _OpenFiles:
    """The safetensors files one read maps, closed together when it ends."""

    def __enter__(self):
        self.stack = contextlib.ExitStack()
        self.open: dict = {}
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def block(self, file: str, key: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        from safetensors import safe_open

        if file not in self.open:
            self.open[file] = self.stack.enter_context(safe_open(file, framework="pt"))
        f = self.open[file]
        if not shape:  # a 0-dim tensor (a scalar buffer) cannot be sliced
            return f.get_tensor(key)
        return f.get_slice(key)[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def model_keys(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(canonical key -> shape of every parameter and persistent buffer, alias -> canonical key for tied copies)."""
    names = canonical_names(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False) if names[n] == n}
    shapes.update({name: tuple(b.shape) for name, b in persistent_buffers(model).items()})
    return shapes, {name: key for name, key in names.items() if name != key}


def check(source: HFSource, model: nn.Module) -> None:
    """Maps the on-disk keys to `model`'s through transformers' conversions (`source.views`) and refuses missing,
    unexpected or wrongly shaped keys, a missing expert, an FP8 weight without its scale: one ConfigError each."""
    shapes, aliases = model_keys(model)
    known = {**shapes, **{a: shapes[k] for a, k in aliases.items() if k in shapes}}
    leaves = {k: Leaf(k, e.file, e.shape, e.dtype) for k, e in source.entries.items()}
    leaves = pair_scales(source.path, leaves, source.quantization)
    source.views, unused = build_views(source.path, leaves, model, known)
    weights = {name for name, _ in model.named_parameters(remove_duplicate=False)}  # float only; buffers any dtype
    what = type(model).__name__
    missing = [k for k in shapes if k not in source.views]
    if missing:
        raise ConfigError(
            f"checkpoint {source.path!r} is missing {missing[0]!r} ({len(missing)} of {len(shapes)} keys missing); "
            f"give the weights of this {what} (its config.json must match them)"
        )
    if unused:
        raise ConfigError(
            f"checkpoint {source.entries[unused[0]].file}: unexpected key {unused[0]!r}, not a parameter or "
            f"persistent buffer of {what}; give the weights of this model (its config.json must match them)"
        )
    for key, view in source.views.items():
        for leaf in leaves_of(view):
            if key in weights and not leaf.dtype.is_floating_point and leaf.method is None:
                raise ConfigError(
                    f"checkpoint {leaf.file}: {leaf.key!r} has dtype {leaf.dtype}, not a float type; store weights "
                    "as F32, BF16 or F16"
                )
        want = known[key]
        if tuple(view.shape) != want:
            where = f"{view.file}: {key!r}" if isinstance(view, Leaf) else f"{source.path!r}: {key!r} (converted)"
            raise ConfigError(
                f"checkpoint {where} has shape {tuple(view.shape)}, the model needs {want}; "
                "check config.json against the weights"
            )


def open_checked(path: str, model: nn.Module) -> HFSource:
    """The checkpoint at `path`, checked against `model` (meta is enough); no collective."""
    if not os.path.isdir(path):
        raise ConfigError(f"checkpoint {path!r} is not a directory; give a Hugging Face model directory")
    source = HFSource(path)
    check(source, model)
    return source
