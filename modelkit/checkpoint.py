"""Checkpoint: the one object every reader returns and every writer takes.

Tensors are lazy: a reader fills in dtype and shape from the file's header and a function that
reads the bytes when asked, so opening a large file reads no tensor data, and a converter holds
one tensor at a time.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modelkit._mapped import FileSpan
from modelkit.errors import ConfigError, FormatError

ARCH_KEY = "modelkit.arch"          # metadata key holding the ArchSpec as JSON
METRICS_KEY = "modelkit.metrics"    # metadata key holding evaluation figures as JSON
ALIASES_KEY = "modelkit.aliases"    # metadata key: tied names -> the name whose tensor they share
_PRIMITIVES = (str, int, float, bool, type(None))


def _is_primitive_tree(value: Any) -> bool:
    if isinstance(value, _PRIMITIVES):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_primitive_tree(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_primitive_tree(v) for k, v in value.items())
    return False


@dataclass(frozen=True)
class ArchSpec:
    """How to rebuild the nn.Module that owns these weights.

    `name` is a key of modelkit.models.MODELS; `config` its constructor arguments (widths,
    layers, vocab...), so pruned or distilled variants rebuild too. A spec read from a file
    only ever names a registered model: nothing from a file decides what code is imported.
    """

    name: str
    config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"ArchSpec name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.config, dict) or not _is_primitive_tree(self.config):
            raise ConfigError(f"ArchSpec config for {self.name!r} must be a dict of JSON values")

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "config": self.config}, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, *, source: str | Path = "<metadata>") -> ArchSpec:
        """Parse a spec stored in a file; refuse anything but a registered model name."""
        from modelkit.models import MODELS

        try:
            raw = json.loads(text)
        except (json.JSONDecodeError, TypeError) as e:
            raise FormatError(source, f"the {ARCH_KEY} entry is not valid JSON ({e})") from e
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not isinstance(raw.get("config", {}), dict):
            raise FormatError(source, f'the {ARCH_KEY} entry must look like {{"name": ..., "config": {{...}}}}')
        if raw["name"] not in MODELS:
            raise FormatError(
                source,
                f"names architecture {raw['name']!r}, which is not a registered model "
                f"(known: {', '.join(MODELS)}); pass --arch to choose one",
            )
        try:
            return cls(raw["name"], raw.get("config", {}))
        except ConfigError as e:
            raise FormatError(source, str(e)) from e


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True, eq=False)
class LazyTensor:
    """A tensor known by its header; `load()` reads the bytes (an mmap view where possible)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    reader: Callable[[], torch.Tensor] = field(repr=False)
    source: str = ""                   # where it comes from, for error messages
    # Where load()'s exact bytes lie in a file, when they do (raw little-endian, contiguous, no
    # transformation): writers copy such spans file to file in the kernel (modelkit._mapped.copy_span).
    span: FileSpan | None = field(default=None, repr=False)

    @classmethod
    def of(cls, tensor: torch.Tensor, *, source: str = "") -> LazyTensor:
        """Wrap a tensor that is already in memory."""
        tensor = tensor.detach()
        return cls(tensor.dtype, tuple(tensor.shape), lambda: tensor, source)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.dtype, self.shape)

    def load(self) -> torch.Tensor:
        """Read the tensor; raises FormatError if the data disagrees with the header."""
        tensor = self.reader()
        if tensor.dtype != self.dtype or tuple(tensor.shape) != self.shape:
            raise FormatError(
                self.source or "<tensor>",
                f"tensor data is {tensor.dtype} {list(tensor.shape)} but the header says "
                f"{self.dtype} {list(self.shape)}",
            )
        return tensor


def _unpack_int4(packed: torch.Tensor, signed: bool) -> torch.Tensor:
    """(..., n/2) uint8, low nibble first -> (..., n) int8 values."""
    low = (packed & 0x0F).to(torch.int16)
    high = (packed >> 4).to(torch.int16)
    values = torch.stack((low, high), dim=-1).flatten(-2)                 # (..., n/2, 2) -> (..., n)
    if signed:
        values = torch.where(values >= 8, values - 16, values)
    return values.to(torch.int8)


def _dequantize_affine(q: QuantizedTensor) -> torch.Tensor:
    """value = (q - zero_point) * scale, one scale per row and group of `group_size` columns.

    Layout: the logical tensor viewed as (rows, cols) with rows = shape[0]; `qdata` holds int8
    values (bits 8) or two 4-bit values per uint8, low nibble first (bits 4); `scale` and the
    optional `zero_point` are (rows, cols / group_size), or (1, 1) for one scale per tensor.
    """
    bits = int(q.params.get("bits", 8))
    rows = q.shape[0] if q.shape else 1
    cols = math.prod(q.shape[1:]) if len(q.shape) > 1 else max(math.prod(q.shape) // max(rows, 1), 1)
    data = q.parts["qdata"].load()
    if bits == 4:
        values = _unpack_int4(data, signed=bool(q.params.get("symmetric", True))).reshape(rows, -1)[:, :cols]
    elif bits == 8:
        values = data.reshape(rows, cols)
    else:
        raise FormatError(q.source or "<tensor>", f"affine quantization with {bits} bits is not a known layout (4 or 8)")
    scale = q.parts["scale"].load().float()
    group = cols if scale.numel() == 1 else cols // scale.shape[-1]
    if group < 1 or (scale.numel() != 1 and scale.shape[-1] * group != cols):
        raise FormatError(q.source or "<tensor>", f"scale shape {list(scale.shape)} does not tile {cols} columns")
    values = values.float().reshape(rows, -1, group)                       # (rows, groups, group)
    if "zero_point" in q.parts:
        values = values - q.parts["zero_point"].load().float().reshape(rows if scale.numel() != 1 else 1, -1, 1)
    out = values * scale.reshape(rows if scale.numel() != 1 else 1, -1, 1)
    return out.reshape(q.shape).to(q.dtype)


# Layout name -> dequantizer. The quantizers add their layouts here (GGUF block types, ...).
DEQUANTIZERS: dict[str, Callable[[QuantizedTensor], torch.Tensor]] = {"affine": _dequantize_affine}

# Layouts whose dequantizer lives in a module imported on first use: layout -> module, which
# registers itself in DEQUANTIZERS. A fixed table in code: a file only ever picks a key of it.
LAYOUT_MODULES: dict[str, str] = {"gguf": "modelkit.quantizers.gguf_blocks"}


def dequantizer(layout: str, *, source: str = "<tensor>") -> Callable[[QuantizedTensor], torch.Tensor]:
    """The dequantizer of `layout`, importing its module from LAYOUT_MODULES on first use."""
    if layout not in DEQUANTIZERS and layout in LAYOUT_MODULES:
        import importlib

        importlib.import_module(LAYOUT_MODULES[layout])
    found = DEQUANTIZERS.get(layout)
    if found is None:
        known = sorted(set(DEQUANTIZERS) | set(LAYOUT_MODULES))
        raise FormatError(source, f"unknown quantized layout {layout!r}; known: {', '.join(known)}")
    return found


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A quantized weight kept as its parts, so writers store it natively instead of in float.

    Args:
        scheme: The quantization scheme that produced it ("int8", "int4", "q4_0", ...).
        layout: How the parts combine: a key of DEQUANTIZERS ("affine": (q - zero_point) * scale).
        shape: The logical (dequantized) shape.
        dtype: The dtype `load()` returns.
        parts: Named stored tensors: "qdata", "scale", optionally "zero_point".
        params: Small layout facts: bits, group_size, symmetric, axis.
    """

    scheme: str
    layout: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: Mapping[str, LazyTensor]
    params: Mapping[str, int | float | str | bool] = field(default_factory=dict)
    source: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes stored: the packed data plus scales and zero points."""
        return sum(part.nbytes for part in self.parts.values())

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / max(self.numel, 1)

    def load(self) -> torch.Tensor:
        """The dequantized tensor."""
        return dequantizer(self.layout, source=self.source or "<tensor>")(self)


TensorEntry = LazyTensor | QuantizedTensor


def _tied_names(state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Names whose tensor is a view of the same memory as an earlier name (tied weights)."""
    seen: dict[tuple, str] = {}
    aliases = {}
    for name, t in state_dict.items():
        if t.numel() == 0 or t.device.type == "meta":
            continue
        identity = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if identity in seen:
            aliases[name] = seen[identity]
        else:
            seen[identity] = name
    return aliases


def _with_checkpoint_entries(ckpt: Checkpoint, module: nn.Module) -> Checkpoint:
    """Let submodules that store their weights in another form (quantized modules) name their entries.

    A submodule with a `checkpoint_entries()` method returns its entries by local name
    ({"weight": QuantizedTensor, "bias": LazyTensor}); they replace all of that submodule's own
    state_dict keys (packed data, scales, ...), at the place of its first key.
    """
    replacements: dict[str, dict[str, TensorEntry] | None] = {}
    for prefix, sub in module.named_modules():
        export = getattr(sub, "checkpoint_entries", None)
        if callable(export):
            dot = f"{prefix}." if prefix else ""
            replacements[dot] = {dot + name: entry for name, entry in export().items()}
    if not replacements:
        return ckpt
    tensors: dict[str, TensorEntry] = {}
    for name, entry in ckpt.tensors.items():
        owner = max((p for p in replacements if name.startswith(p) and "." not in name[len(p):]), key=len, default=None)
        if owner is None:
            tensors[name] = entry
        elif replacements[owner] is not None:
            tensors.update(replacements[owner])
            replacements[owner] = None       # emitted once, where the submodule's first key was
    return Checkpoint(tensors, ckpt.metadata, ckpt.arch)


@dataclass
class Checkpoint:
    """What every converter reads and writes: named tensors read on demand, str metadata, an ArchSpec.

    Example:
        >>> from modelkit.models import build
        >>> ckpt = Checkpoint.from_module(build("mlp", seed=0))
        >>> ckpt.arch.name, ckpt.num_parameters
        ('mlp', 752)
    """

    tensors: Mapping[str, TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)
    arch: ArchSpec | None = None

    def __post_init__(self) -> None:
        bad = [k for k, v in self.metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise ConfigError(f"checkpoint metadata must map str to str; bad entry {bad[0]!r}")

    @classmethod
    def from_state_dict(
        cls, state_dict: Mapping[str, torch.Tensor], *, arch: ArchSpec | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Checkpoint:
        metadata = dict(metadata or {})
        aliases = _tied_names(state_dict)
        if aliases:
            metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
        return cls({name: LazyTensor.of(t, source=name) for name, t in state_dict.items()}, metadata, arch)

    @classmethod
    def from_module(
        cls, module: nn.Module, *, arch: ArchSpec | None = None, metadata: Mapping[str, str] | None = None,
    ) -> Checkpoint:
        """Wrap a module's state_dict; a reference model's ArchSpec is filled in automatically."""
        if arch is None and getattr(type(module), "arch", None):
            from modelkit.models import arch_spec

            arch = arch_spec(module)
        ckpt = cls.from_state_dict(module.state_dict(), arch=arch, metadata=metadata)
        return _with_checkpoint_entries(ckpt, module)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def num_parameters(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def metrics(self) -> dict[str, Any]:
        """Evaluation figures stored by `modelkit train` (empty when none)."""
        try:
            value = json.loads(self.metadata.get(METRICS_KEY, "{}"))
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}

    def materialize(self) -> dict[str, torch.Tensor]:
        """Read every tensor (dequantized): for small models and tests, never inside a converter."""
        return {name: t.load() for name, t in self.tensors.items()}
