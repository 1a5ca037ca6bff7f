"""Convert between formats and export modules, verifying the result before it takes its final name.

Weight containers convert on the Checkpoint alone, one tensor at a time. Graph targets get a
module rebuilt from the ArchSpec (or `arch`). Writing and verification go through the one write
path (modelkit.pipeline.write), on the temporary output:

- weights: every tensor read back from the output equals the source (cast to `dtype` when one
  was asked for) bit for bit;
- graphs: additionally the output's own runtime (onnxruntime, the ScriptModule) and torch eager
  run seeded sample inputs, and the largest difference must be within the format's tolerance.

A failed verification raises VerificationError and leaves no output.
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelkit.checkpoint import ArchSpec, Checkpoint, LazyTensor, QuantizedTensor, instantiate
from modelkit.errors import ConfigError, UnsupportedConversionError, did_you_mean
from modelkit.formats import (
    FORMATS,
    ReadOptions,
    WriteOptions,
    check_readable,
    detect_format,
    format_for_output,
    load_format,
)
from modelkit.pipeline.write import collections_deferred, write_checkpoint
from modelkit.storage.dtypes import DTYPE_NAMES, DType, as_dtype, cast_float, dtype_name

if TYPE_CHECKING:       # weight containers convert without torch; graphs import it where they are built
    import torch
    from torch import nn

PathLike = str | os.PathLike[str]
ProgressFn = Callable[[int, int], None]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str | int) -> int:
    """'2GB' -> 2_000_000_000, '500MiB' -> 524_288_000 (decimal units as Hugging Face uses)."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(text)
        unit = (match.group(2) or "").lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(f"cannot read size {text!r}; use a number of bytes or e.g. 500MB, 2GB, 1GiB")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise ConfigError(f"size must be positive, got {text!r}")
    return value


def parse_dtype(name: str | DType | torch.dtype | None) -> DType | None:
    if name is None:
        return None
    if not isinstance(name, str):
        return as_dtype(name)
    if name not in DTYPE_NAMES:
        raise ConfigError(f"unknown dtype {name!r}; known: {', '.join(DTYPE_NAMES)}{did_you_mean(name, DTYPE_NAMES)}")
    return DTYPE_NAMES[name]


@dataclass
class ConversionReport:
    """What `convert` and `export` did; `to_dict()` is the CLI's --json document body."""

    source: dict[str, Any]
    target: dict[str, Any]
    tensors: int
    parameters: int
    verify: dict[str, Any] | None
    seconds: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "target": self.target, "tensors": self.tensors,
                "parameters": self.parameters, "verify": self.verify, "seconds": round(self.seconds, 3),
                "notes": self.notes}


def _cast(ckpt: Checkpoint, dtype: DType | None) -> Checkpoint:
    """Floating-point tensors cast to `dtype` as they are read (numpy, rounding as torch does); quantized
    tensors (GGUF blocks, K-quants included) dequantized, then cast; everything else unchanged."""
    if dtype is None:
        return ckpt
    tensors = {}
    for name, t in ckpt.tensors.items():
        if isinstance(t, LazyTensor) and t.dtype.is_floating_point and t.dtype is not dtype:
            tensors[name] = LazyTensor(dtype, t.shape, lambda t=t: _cast_array(t, dtype), t.source)
        elif isinstance(t, QuantizedTensor) and dtype.is_floating_point:
            tensors[name] = LazyTensor(dtype, t.shape, lambda t=t: t.load().to(dtype.torch), t.source)
        else:
            tensors[name] = t
    return Checkpoint(tensors, dict(ckpt.metadata), ckpt.arch, ckpt.assets)


def _cast_array(t: LazyTensor, dtype: DType) -> Any:
    try:
        return cast_float(t.array(), t.dtype, dtype)
    except ValueError:          # float8 and other types numpy cannot compute with: torch casts them
        return t.load().to(dtype.torch)


def convert(
    src: PathLike, dst: PathLike, *, to: str | None = None, source_format: str | None = None,
    dtype: str | DType | torch.dtype | None = None, arch: ArchSpec | str | None = None, shard_size: int | str | None = None,
    verify: bool = True, force: bool = False, trust: bool = False, key: str | None = None,
    progress: ProgressFn | None = None, example_inputs: Any = None, dynamic: Any = None, kv_cache: bool = False,
) -> ConversionReport:
    """Convert a model file to another format (or dtype), verified before it takes its final name.

    Args:
        src: Input file (or sharded safetensors folder); its format is detected from content.
        dst: Output path; its format comes from `to` or its suffix. With `shard_size`, a folder.
        to: Output format name ("onnx", "gguf", ...).
        source_format: Read `src` as this format instead of detecting it.
        dtype: Cast floating-point tensors: "f32", "f16" or "bf16".
        arch: For graph targets (and HDF5's Keras layout) when `src` names no architecture: a
            registered model name or a factory "module:function" / "module:Class", imported with
            the current directory first on the path (never taken from a file).
        shard_size: safetensors, hf and tfjs only: split into shards of at most this size ("2GB" or bytes).
        verify: Check the output (on by default); a failure raises VerificationError, no output.
        force: Overwrite an existing `dst`.
        trust: Allow inputs that run code when loaded (whole-module pickles, TorchScript).
        key: For nested checkpoints, the entry holding the state_dict.
        progress: Called with (bytes done, bytes total) as tensors are written.
        example_inputs: For a user's module (`arch="module:function"`): tensors (one, a tuple, or
            {name: tensor}) or specs "[NAME=]DIMS[:DTYPE][:LOW..HIGH]" ("ids=1x16:int64"), made
            into seeded random tensors (modelkit.pipeline.inputs has the rules). Graph exports
            run on them, verification compares on them, HDF5's Keras layout takes their shapes.
        dynamic: Free axes of the graph (ONNX, pt2): ["input:0", "ids:1"] or {"ids": [0, 1]}; default:
            axis 0 of every input.
        kv_cache: ONNX of a Hugging Face causal LM: also past_key_values.N.key/value in and
            present.N.key/value out, checked on a prefill and a decode step (docs/formats/onnx.md).

    Returns:
        ConversionReport: source, target (path, format, bytes), verification result, seconds.

    Example:
        >>> report = modelkit.convert("runs/cnn/model.safetensors", "cnn.onnx")   # doctest: +SKIP
        >>> report.verify["passed"]                                                # doctest: +SKIP
        True
    """
    started = time.perf_counter()
    src, dst = Path(src), Path(dst)
    check_readable(src)
    in_fmt = source_format or detect_format(src)
    if source_format is not None:
        load_format(source_format)
    cast = parse_dtype(dtype)
    shard_bytes = parse_size(shard_size) if shard_size is not None else None
    if to is None and shard_bytes is not None and not dst.suffix and not FORMATS[in_fmt].folder:
        to = "safetensors"                      # a sharded checkpoint is a folder (a Hugging Face folder's: hf)
    out_fmt = format_for_output(dst, to, source=in_fmt)
    _check_kv_cache(kv_cache, out_fmt)
    if shard_bytes is not None and out_fmt not in ("safetensors", "hf", "tfjs"):
        raise ConfigError(f"--shard-size applies to safetensors, hf and tfjs output only, not {out_fmt}")
    if dst.resolve() == src.resolve():
        raise ConfigError(f"{dst} is the input file; choose another output path (inputs are never modified)")

    # weights only (no graph to export): no cyclic collection while the file is read, written and checked
    with collections_deferred() if not FORMATS[out_fmt].has_graph else nullcontext():
        ckpt = load_format(in_fmt).read(src, ReadOptions(trust=trust, key=key))
        notes: list[str] = []
        if isinstance(arch, str) and ":" not in arch:
            arch = ArchSpec(arch, ckpt.arch.config if ckpt.arch and ckpt.arch.name == arch else {})
        if isinstance(arch, ArchSpec):
            ckpt = Checkpoint(ckpt.tensors, ckpt.metadata, arch, ckpt.assets)
            adopt = getattr(load_format(in_fmt), "adopt_arch", None)      # tfjs: a foreign Keras model's names
            if adopt is not None:
                ckpt = adopt(ckpt)
        ckpt = _cast(ckpt, cast)

        module = None
        options = WriteOptions(shard_size=shard_bytes, final_path=dst)
        factory = isinstance(arch, str) and ":" in arch
        if FORMATS[out_fmt].has_graph or (factory and FORMATS[out_fmt].maps_module):
            # built here, once, so the writer exports and the verification runs the same module
            module = instantiate(ckpt, arch=arch if isinstance(arch, str) else None, source=str(src), target=out_fmt,
                                 dequantize=True)
            if cast is not None:
                module = module.to(cast.torch)
            options = replace(_module_options(module, example_inputs, dynamic, cast, final_path=dst), kv_cache=kv_cache)
        elif example_inputs is not None or dynamic:
            raise ConfigError(f"example inputs and dynamic axes apply to graph outputs (onnx, pt2, torchscript) and HDF5's "
                              f"Keras layout of a user's module, not to {out_fmt}")
        if not FORMATS[out_fmt].has_graph:
            module = None                            # a mapped module (Keras layout) is not run: weights are checked
        sharded = shard_bytes is not None
        verify_result, size = write_checkpoint(ckpt, dst, out_fmt, options, force=force, verify=verify,
                                              module=module, sharded=sharded, progress=progress)
        return ConversionReport(
            source={"path": str(src), "format": in_fmt},
            target={"path": str(dst), "format": out_fmt, "bytes": size, "dtype": dtype_name(cast) if cast else None},
            tensors=len(ckpt), parameters=ckpt.num_parameters, verify=verify_result,
            seconds=time.perf_counter() - started, notes=notes,
        )


def _check_kv_cache(kv_cache: bool, fmt: str) -> None:
    if kv_cache and fmt != "onnx":
        raise ConfigError(f"--kv-cache (API: kv_cache=True) applies to ONNX output of a causal LM, not to {fmt}")


def _module_options(module: nn.Module, given: Any, dynamic: Any, cast: DType | None, *,
                    final_path: Path) -> WriteOptions:
    """The writer's options for `module` with the caller's example inputs (tensors or specs) and axes."""
    from modelkit.pipeline.inputs import example_inputs

    if given is None:                   # a module built from a file's topology knows its inputs' shapes
        given = getattr(module, "input_specs", None)
    example = example_inputs(module, given, dynamic)
    if example is None:
        return WriteOptions(module=module, final_path=final_path)
    tensors = example.tensors
    if cast is not None:        # a module cast to f16/bf16 takes floating inputs of that dtype
        tensors = tuple(x.to(cast.torch) if x.is_floating_point() else x for x in tensors)
    return WriteOptions(module=module, example_inputs=tensors, input_names=example.names,
                        dynamic_axes=example.dynamic, final_path=final_path)


def _makes_own_inputs(module: nn.Module) -> bool:
    """A Hugging Face causal LM: the ONNX writer and the check make its token inputs themselves."""
    from modelkit.testing.causal_lm import is_causal_lm

    return is_causal_lm(module)


def export(
    module: nn.Module, path: PathLike, *, example_inputs: Any = None, dynamic: Any = None,
    format: str | None = None, arch: ArchSpec | None = None, metadata: dict[str, str] | None = None,
    verify: bool = True, force: bool = False, kv_cache: bool = False,
) -> ConversionReport:
    """Save any nn.Module (not only the zoo) to any format, verified: the export-script case.

    Args:
        module: The model to export (left unchanged).
        path: Output path; the format comes from `format` or the suffix.
        example_inputs: Sample inputs for graph export and the output check (reference models
            have their own): a tensor, a tuple of tensors in `forward`'s order, {name: tensor} (the
            names name the ONNX inputs), or specs as `convert` takes them ("ids=1x16:int64").
        dynamic: Free axes of the graph (ONNX, pt2) by input name: {"ids": [0, 1]} or ["ids:0", "ids:1"];
            default: axis 0 of every input.
        format: Output format name.
        arch: The ArchSpec to record (filled in for reference models).
        metadata: str -> str pairs to store with the weights.
        verify: Check the written file (on by default).
        force: Overwrite an existing file.
        kv_cache: ONNX of a Hugging Face causal LM: past key/values in, present key/values out.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 2))                                     # doctest: +SKIP
        >>> modelkit.export(net, "net.onnx", example_inputs=torch.randn(1, 4)).verify["passed"]   # doctest: +SKIP
        True
    """
    started = time.perf_counter()
    path = Path(path)
    fmt = format_for_output(path, format)
    _check_kv_cache(kv_cache, fmt)
    ckpt = Checkpoint.from_module(module, arch=arch, metadata=metadata)
    module = module.eval()
    options = replace(_module_options(module, example_inputs, dynamic, None, final_path=path), kv_cache=kv_cache)
    if FORMATS[fmt].has_graph and options.example_inputs is None and ckpt.arch is None and not _makes_own_inputs(module):
        raise UnsupportedConversionError(type(module).__name__, fmt, "exporting a graph needs example_inputs "
                                         "(a tensor or tuple shaped like real inputs)")
    verify_result, size = write_checkpoint(ckpt, path, fmt, options, force=force, verify=verify,
                                          module=module, sharded=False)
    return ConversionReport(
        source={"module": type(module).__name__, "arch": ckpt.arch.name if ckpt.arch else None},
        target={"path": str(path), "format": fmt, "bytes": size}, tensors=len(ckpt),
        parameters=ckpt.num_parameters, verify=verify_result, seconds=time.perf_counter() - started,
    )
