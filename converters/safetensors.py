"""safetensors: named tensors plus a str->str header; loading runs no code.

Spec: https://github.com/huggingface/safetensors#format
Layout: 8-byte little-endian header length N | N bytes of JSON (padded with spaces to a multiple
of 8) | tensor data. The JSON maps each name to {"dtype", "shape", "data_offsets": [begin, end]}
(offsets relative to the end of the header) and "__metadata__" to str->str pairs. modelkit
stores "format": "pt" (as transformers does) and the ArchSpec under "modelkit.arch".

Reading is lazy: the header gives names, dtypes and shapes; each tensor's bytes are read when
asked for. Writing streams: the header is computed from the specs, then each tensor is read
and written in turn, so peak memory is one tensor, not the model.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from modelkit._tensors import SAFETENSORS_CODES, SAFETENSORS_DTYPES, tensor_bytes
from modelkit.checkpoint import ARCH_KEY, ArchSpec, Checkpoint, LazyTensor, QuantizedTensor
from modelkit.errors import FormatError, UnsupportedConversionError

_HEADER_LIMIT = 100_000_000      # the reference implementation's own cap on header size
_ALIGN = 8


def detect(path: Path) -> bool:
    """True if `path` starts like safetensors: a plausible 8-byte header length, then '{'."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        head = f.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    (length,) = struct.unpack("<Q", head[:8])
    return 2 <= length <= min(_HEADER_LIMIT, path.stat().st_size - 8)


class _File:
    """One safe_open handle shared by a checkpoint's tensors, opened on first use."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle: Any = None

    def get(self, name: str) -> torch.Tensor:
        if self._handle is None:
            self._handle = safe_open(str(self.path), framework="pt")
        try:
            return self._handle.get_tensor(name)
        except SafetensorError as e:
            raise FormatError(self.path, f"cannot read tensor {name!r} ({e})") from e


def read(path: Path) -> Checkpoint:
    """Open `path` and read its header; tensor data is read only when a tensor is loaded."""
    try:
        with safe_open(str(path), framework="pt") as f:   # validates header, offsets and sizes
            metadata = dict(f.metadata() or {})
            specs = {name: f.get_slice(name) for name in f.keys()}
            headers = {name: (spec.get_dtype(), tuple(spec.get_shape())) for name, spec in specs.items()}
    except (SafetensorError, OSError) as e:
        raise FormatError(path, f"not a readable safetensors file ({e})") from e
    handle = _File(path)
    tensors = {}
    for name, (code, shape) in headers.items():
        dtype = SAFETENSORS_DTYPES.get(code)
        if dtype is None:
            raise FormatError(path, f"tensor {name!r} has dtype {code!r}, which torch cannot hold")
        tensors[name] = LazyTensor(dtype, shape, lambda name=name: handle.get(name), f"{path}:{name}")
    arch_json = metadata.pop(ARCH_KEY, None)
    arch = ArchSpec.from_json(arch_json, source=path) if arch_json is not None else None
    return Checkpoint(tensors=tensors, metadata=metadata, arch=arch)


def write(ckpt: Checkpoint, path: Path) -> None:
    """Write `ckpt` to `path` (the caller makes the write atomic), one tensor at a time."""
    metadata = {"format": "pt", **ckpt.metadata}
    if ckpt.arch is not None:
        metadata[ARCH_KEY] = ckpt.arch.to_json()
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, entry in ckpt.tensors.items():
        if isinstance(entry, QuantizedTensor):
            raise UnsupportedConversionError(
                "quantized checkpoint", "safetensors",
                f"tensor {name!r} is quantized ({entry.scheme}); dequantize it first",
            )
        code = SAFETENSORS_CODES.get(entry.dtype)
        if code is None:
            raise UnsupportedConversionError(str(entry.dtype), "safetensors", f"tensor {name!r} has a dtype safetensors lacks")
        header[name] = {"dtype": code, "shape": list(entry.shape), "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % _ALIGN)                       # data starts 8-byte aligned
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for entry in ckpt.tensors.values():
            out.write(tensor_bytes(entry.load()))
