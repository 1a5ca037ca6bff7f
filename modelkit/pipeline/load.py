"""Open model files: as a lazy Checkpoint, or rebuilt into a runnable module (float or quantized).

Every reader is reached through the format table; pickle-bearing formats pass the scanner gate
inside their converter before anything is read.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from modelkit.checkpoint import ArchSpec, Checkpoint, QuantizedTensor
from modelkit.errors import ConfigError, UnsupportedConversionError
from modelkit.formats import (
    FORMATS,
    ReadOptions,
    WriteOptions,
    check_readable,
    detect_format,
    format_for_output,
    load_format,
)
from modelkit.storage.atomic import atomic_path

if TYPE_CHECKING:
    from torch import nn

PathLike = str | os.PathLike[str]


def resolve_input(path: PathLike, format: str | None) -> tuple[Path, str]:
    path = Path(path)
    check_readable(path)
    if format is not None:
        load_format(format)  # unknown names raise with "did you mean"
        return path, format
    return path, detect_format(path)


def load(path: PathLike, *, format: str | None = None, trust: bool = False, key: str | None = None,
         dequantize: bool = False) -> Checkpoint:
    """Open a model file as a lazy Checkpoint; no tensor data is read until asked for.

    Args:
        path: The file (or sharded folder) to read.
        format: Force a format instead of detecting it from the content.
        trust: Allow content that runs code when loaded (whole-module pickles, TorchScript).
        key: For nested checkpoints, the entry holding the state_dict ("model", "state_dict").
        dequantize: Return quantized tensors (GGUF block types) as float tensors.

    Example:
        >>> ckpt = modelkit.load("runs/cnn/model.safetensors")       # doctest: +SKIP
        >>> ckpt.arch.name, ckpt.num_parameters                       # doctest: +SKIP
        ('cnn', 38538)
    """
    path, fmt = resolve_input(path, format)
    return load_format(fmt).read(path, ReadOptions(trust=trust, key=key, dequantize=dequantize))


def save(ckpt: Checkpoint, path: PathLike, *, format: str | None = None, force: bool = False) -> Path:
    """Write `ckpt` to `path` atomically (temporary file, fsync, rename); returns the path.

    The format comes from `format` or the path's suffix. An existing file needs `force=True`.
    """
    path = Path(path)
    fmt = format_for_output(path, format)
    with atomic_path(path, force=force, companions=FORMATS[fmt].companions) as tmp:
        load_format(fmt).write(ckpt, tmp, WriteOptions(final_path=path))
    return path


def load_module(path: PathLike, *, format: str | None = None, arch: ArchSpec | str | None = None,
                trust: bool = False) -> nn.Module:
    """Rebuild a runnable model from a file: its ArchSpec (or `arch`) plus its weights.

    Args:
        path: Any readable model file.
        format: Force a format instead of detecting it.
        arch: A registered model name, an ArchSpec, or a factory "pkg.module:function", for
            files that name no architecture (or to override it).
        trust: Allow content that runs code when loaded (see `load`).

    Raises:
        UnsupportedConversionError: the file names no architecture and none was given.

    Example:
        >>> model = modelkit.load_module("runs/cnn/model.safetensors")   # doctest: +SKIP
    """
    from modelkit.checkpoint import instantiate

    ckpt = load(path, format=format, trust=trust)
    if any(isinstance(t, QuantizedTensor) for t in ckpt.tensors.values()):   # quantized layers, not dequantized floats
        return instantiate_quantized(ckpt, arch=arch, source=str(path))
    return instantiate(ckpt, arch=arch, source=str(path))


def instantiate_quantized(ckpt: Checkpoint, *, arch: ArchSpec | str | None = None, source: str = "checkpoint") -> nn.Module:
    """Rebuild a runnable quantized model: the float model from the ArchSpec, quantized layers
    holding the file's QuantizedTensors as stored (nothing is re-quantized), the rest loaded."""
    from modelkit.models import build_from_spec, load_factory
    from modelkit.quantizers import _modules

    if isinstance(arch, str) and ":" in arch:
        model = load_factory(arch)()
    else:
        if isinstance(arch, str):
            arch = ArchSpec(arch, ckpt.arch.config if ckpt.arch and ckpt.arch.name == arch else {})
        spec = arch or ckpt.arch
        if spec is None:
            raise UnsupportedConversionError(source, "a runnable model", "the file names no architecture; pass --arch NAME")
        model = build_from_spec(spec)
    quantized = {n: t for n, t in ckpt.tensors.items() if isinstance(t, QuantizedTensor)}
    model = _modules.rebuild(model, quantized, source=source)
    state = {n: t.load() for n, t in ckpt.tensors.items() if not isinstance(t, QuantizedTensor)}
    owners = {n.rpartition(".")[0] for n in quantized}
    expected = {k for k in model.state_dict()
                if k.rpartition(".")[0] not in owners or k.rpartition(".")[2] in ("bias",)}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - set(model.state_dict()))
    if missing or unexpected:
        raise ConfigError(f"{source}: weights do not fit the architecture"
                          + (f"; missing {missing[:3]}" if missing else "") + (f"; unexpected {unexpected[:3]}" if unexpected else ""))
    current = model.state_dict()
    wrong = [k for k in state if tuple(current[k].shape) != tuple(state[k].shape)]
    if wrong:
        raise ConfigError(f"{source}: {wrong[0]} is {list(state[wrong[0]].shape)}, the model expects {list(current[wrong[0]].shape)}")
    model.load_state_dict(state, strict=False)
    return model.eval()
