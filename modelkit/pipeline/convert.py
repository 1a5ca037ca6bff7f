"""Convert between formats and export modules, verifying the result before it takes its final name.

Weight containers convert on the Checkpoint alone, one tensor at a time. Graph targets get a
module rebuilt from the ArchSpec (or `arch`). Verification runs on the temporary output:

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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from modelkit.checkpoint import ArchSpec, Checkpoint, LazyTensor, QuantizedTensor
from modelkit.errors import ConfigError, UnsupportedConversionError, VerificationError, did_you_mean
from modelkit.formats import (
    FORMATS,
    ReadOptions,
    WriteOptions,
    check_readable,
    detect_format,
    format_for_output,
    load_format,
)
from modelkit.storage.atomic import atomic_dir, atomic_path, sync_in_background
from modelkit.storage.dtypes import DTYPE_NAMES, dtype_name

if TYPE_CHECKING:
    from torch import nn

PathLike = str | os.PathLike[str]
ProgressFn = Callable[[int, int], None]

# Largest |eager - runtime| accepted for graph formats, per format and dtype. Measured on the
# reference models on 2026-11-21 (see docs/formats/<name>.md for the figures), then pinned with
# headroom: float32 kernels differ in summation order, not in what they compute.
GRAPH_ATOL: dict[tuple[str, torch.dtype], float] = {
    ("onnx", torch.float32): 1e-4,
    ("torchscript", torch.float32): 1e-5,
    ("onnx", torch.float16): 5e-2,
    ("torchscript", torch.float16): 5e-2,
    ("onnx", torch.bfloat16): 2e-1,
    ("torchscript", torch.bfloat16): 2e-1,
}

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


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
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


def _cast(ckpt: Checkpoint, dtype: torch.dtype | None) -> Checkpoint:
    """Floating-point tensors cast to `dtype` as they are read; everything else unchanged."""
    if dtype is None:
        return ckpt
    tensors = {}
    for name, t in ckpt.tensors.items():
        if isinstance(t, LazyTensor) and t.dtype.is_floating_point and t.dtype != dtype:
            tensors[name] = LazyTensor(dtype, t.shape, lambda t=t: t.load().to(dtype), t.source)
        else:
            tensors[name] = t
    return Checkpoint(tensors, dict(ckpt.metadata), ckpt.arch)


def _with_progress(ckpt: Checkpoint, progress: ProgressFn | None) -> Checkpoint:
    """Report bytes as the writer pulls tensors: writers need no progress code of their own."""
    if progress is None:
        return ckpt
    total = max(ckpt.nbytes, 1)
    done = [0]

    def wrap(t: LazyTensor) -> LazyTensor:
        def advance() -> None:
            done[0] += t.nbytes
            progress(min(done[0], total), total)

        def read() -> torch.Tensor:
            tensor = t.load()
            advance()
            return tensor
        span = None if t.span is None else replace(t.span, copied=advance)     # copied file to file: counted there
        return LazyTensor(t.dtype, t.shape, read, t.source, span=span)

    tensors = {n: wrap(t) if isinstance(t, LazyTensor) else t for n, t in ckpt.tensors.items()}
    return Checkpoint(tensors, dict(ckpt.metadata), ckpt.arch)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    x, y = a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    if _int64_viewable(x) and _int64_viewable(y):      # torch.equal is 5x faster on int64 than on bytes
        x, y = x.view(torch.int64), y.view(torch.int64)
    return torch.equal(x, y)


def _int64_viewable(raw: torch.Tensor) -> bool:
    return raw.numel() % 8 == 0 and raw.storage_offset() % 8 == 0 and raw.data_ptr() % 8 == 0


def verify_weights(expected: Checkpoint, written: Checkpoint, *, label: str) -> dict[str, Any]:
    """Every tensor of `expected` is in `written` with the same dtype, shape and bits."""
    missing = [n for n in expected.tensors if n not in written.tensors]
    if missing:
        raise VerificationError(f"{label}: tensor {missing[0]!r} is missing from the output", max_abs_err=float("inf"), atol=0.0)
    for name, entry in expected.tensors.items():
        if isinstance(entry, QuantizedTensor):
            want, got = entry.load(), written.tensors[name].load()
        else:
            want, got = entry.load(), written.tensors[name].load()
        if not _same_bits(want, got):
            err = float((want.double() - got.double()).abs().max()) if want.shape == got.shape and want.dtype != torch.bool else float("inf")
            raise VerificationError(f"{label}: tensor {name!r} differs ({dtype_name(want.dtype)} {list(want.shape)} "
                                    f"vs {dtype_name(got.dtype)} {list(got.shape)})", max_abs_err=err, atol=0.0)
    return {"method": "bit-exact", "tensors_checked": len(expected.tensors), "max_abs_err": 0.0, "atol": 0.0, "passed": True}


def _sample_inputs(module: nn.Module, example_inputs: tuple[Any, ...] | None) -> list[tuple[Any, ...]]:
    """Seeded inputs: the caller's, or the reference model's at a few batch sizes."""
    if example_inputs is not None:
        return [tuple(example_inputs)]
    from modelkit.models import MODELS, load_model_module

    name = getattr(type(module), "arch", None)
    if name not in MODELS:
        raise ConfigError(f"{type(module).__name__} is not a reference model: pass example_inputs for export and checks")
    make = load_model_module(name).example_inputs
    dtype = _module_dtype(module)       # a module cast to f16/bf16 takes inputs of that dtype
    return [tuple(x.to(dtype) if x.is_floating_point() else x for x in (make(batch, seed=seed),))
            for seed, batch in enumerate((1, 3))]


@torch.no_grad()
def verify_outputs(module: nn.Module, run: Callable[..., torch.Tensor], inputs: list[tuple[Any, ...]], *,
                   atol: float, label: str) -> dict[str, Any]:
    """Largest |eager - runtime| over the sample inputs; VerificationError beyond `atol`."""
    module.eval()
    worst = 0.0
    for args in inputs:
        expected = module(*args).float()
        actual = torch.as_tensor(run(*args)).float()
        if expected.shape != actual.shape:
            raise VerificationError(f"{label}: output shape {list(actual.shape)} != eager {list(expected.shape)}",
                                    max_abs_err=float("inf"), atol=atol)
        worst = max(worst, float((expected - actual).abs().max()) if expected.numel() else 0.0)
    if not worst <= atol:
        raise VerificationError(f"{label}: outputs differ from torch eager", max_abs_err=worst, atol=atol)
    return {"method": "outputs", "inputs": len(inputs), "max_abs_err": worst, "atol": atol, "passed": True}


def _graph_atol(fmt: str, dtype: torch.dtype) -> float:
    return GRAPH_ATOL.get((fmt, dtype), GRAPH_ATOL.get((fmt, torch.float32), 1e-4))


def _module_dtype(module: nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.float32


def write_verified(ckpt: Checkpoint, target: Path, fmt: str, options: WriteOptions, *, force: bool,
                   verify: bool, module: nn.Module | None, sharded: bool = False,
                   progress: ProgressFn | None = None,
                   also: Callable[[Path, Checkpoint], dict[str, Any]] | None = None) -> tuple[dict[str, Any] | None, int]:
    """Write to a temporary name, verify there, then rename into place. Returns (verify, bytes).

    `also(tmp, written)` adds checks of its own (the quantizer's rebuilt-model check); what it
    returns joins the verification result, and raising leaves no output, as any failed check does.
    """
    converter = load_format(fmt)
    opener = atomic_dir if sharded else atomic_path
    atomic = {} if sharded else {"companions": FORMATS[fmt].companions}
    with opener(target, force=force, **atomic) as tmp:
        converter.write(_with_progress(ckpt, progress), tmp, options)
        result = None
        if verify:
            wait_synced = sync_in_background(tmp if tmp.is_dir() else tmp.parent)   # disk writes while the CPU verifies
            try:
                result = _verify_written(ckpt, converter, tmp, fmt, options, target, module, also)
            except BaseException:
                wait_synced(check=False)             # the verification's error is the one to report
                raise
            wait_synced()
        size = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()) if tmp.is_dir() else tmp.stat().st_size
    return result, size


def _verify_written(ckpt: Checkpoint, converter: Any, tmp: Path, fmt: str, options: WriteOptions, target: Path,
                    module: nn.Module | None,
                    also: Callable[[Path, Checkpoint], dict[str, Any]] | None) -> dict[str, Any]:
    """Read the output back and check it: every tensor bit-exact, the graph's outputs, `also`'s checks."""
    written = converter.read(tmp, ReadOptions(trust=True))   # our own fresh output
    result = verify_weights(ckpt, written, label=str(target))
    if FORMATS[fmt].has_graph and module is not None:
        runtime = converter.runnable(tmp, ReadOptions(trust=True))
        atol = _graph_atol(fmt, _module_dtype(module))
        outputs = verify_outputs(module, runtime, _sample_inputs(module, options.example_inputs),
                                 atol=atol, label=str(target))
        result = {**outputs, "tensors_checked": result["tensors_checked"], "weights": "bit-exact"}
    if also is not None:
        result = {**result, **also(tmp, written)}
    return result


def convert(
    src: PathLike, dst: PathLike, *, to: str | None = None, source_format: str | None = None,
    dtype: str | torch.dtype | None = None, arch: ArchSpec | str | None = None, shard_size: int | str | None = None,
    verify: bool = True, force: bool = False, trust: bool = False, key: str | None = None,
    progress: ProgressFn | None = None,
) -> ConversionReport:
    """Convert a model file to another format (or dtype), verified before it takes its final name.

    Args:
        src: Input file (or sharded safetensors folder); its format is detected from content.
        dst: Output path; its format comes from `to` or its suffix. With `shard_size`, a folder.
        to: Output format name ("onnx", "gguf", ...).
        source_format: Read `src` as this format instead of detecting it.
        dtype: Cast floating-point tensors: "f32", "f16" or "bf16".
        arch: For graph targets when `src` names no architecture: a registered model name or a
            factory "pkg.module:function" (never taken from a file).
        shard_size: safetensors only: split into shards of at most this size ("2GB" or bytes).
        verify: Check the output (on by default); a failure raises VerificationError, no output.
        force: Overwrite an existing `dst`.
        trust: Allow inputs that run code when loaded (whole-module pickles, TorchScript).
        key: For nested checkpoints, the entry holding the state_dict.
        progress: Called with (bytes done, bytes total) as tensors are written.

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
    if to is None and shard_bytes is not None and not dst.suffix:
        to = "safetensors"                      # a sharded checkpoint is a folder
    out_fmt = format_for_output(dst, to)
    if shard_bytes is not None and out_fmt != "safetensors":
        raise ConfigError(f"--shard-size applies to safetensors output only, not {out_fmt}")
    if dst.resolve() == src.resolve():
        raise ConfigError(f"{dst} is the input file; choose another output path (inputs are never modified)")

    ckpt = load_format(in_fmt).read(src, ReadOptions(trust=trust, key=key))
    notes: list[str] = []
    if isinstance(arch, str) and ":" not in arch:
        arch = ArchSpec(arch, ckpt.arch.config if ckpt.arch and ckpt.arch.name == arch else {})
    if isinstance(arch, ArchSpec):
        ckpt = Checkpoint(ckpt.tensors, ckpt.metadata, arch)
    ckpt = _cast(ckpt, cast)

    module = None
    options = WriteOptions(shard_size=shard_bytes, final_path=dst)
    if FORMATS[out_fmt].has_graph:
        from modelkit.checkpoint import instantiate

        module = instantiate(ckpt, arch=arch if isinstance(arch, str) else None, source=str(src), target=out_fmt)
        if cast is not None:
            module = module.to(cast)
        options = WriteOptions(module=module, final_path=dst)
    sharded = shard_bytes is not None
    verify_result, size = write_verified(ckpt, dst, out_fmt, options, force=force, verify=verify,
                                          module=module, sharded=sharded, progress=progress)
    return ConversionReport(
        source={"path": str(src), "format": in_fmt},
        target={"path": str(dst), "format": out_fmt, "bytes": size, "dtype": dtype_name(cast) if cast else None},
        tensors=len(ckpt), parameters=ckpt.num_parameters, verify=verify_result,
        seconds=time.perf_counter() - started, notes=notes,
    )


def export(
    module: nn.Module, path: PathLike, *, example_inputs: tuple[Any, ...] | Any | None = None,
    format: str | None = None, arch: ArchSpec | None = None, metadata: dict[str, str] | None = None,
    verify: bool = True, force: bool = False,
) -> ConversionReport:
    """Save any nn.Module (not only the zoo) to any format, verified: the export-script case.

    Args:
        module: The model to export (left unchanged).
        path: Output path; the format comes from `format` or the suffix.
        example_inputs: Sample inputs (a tensor or a tuple) for graph export and the output check;
            reference models have their own.
        format: Output format name.
        arch: The ArchSpec to record (filled in for reference models).
        metadata: str -> str pairs to store with the weights.
        verify: Check the written file (on by default).
        force: Overwrite an existing file.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 2))                                     # doctest: +SKIP
        >>> modelkit.export(net, "net.onnx", example_inputs=torch.randn(1, 4)).verify["passed"]   # doctest: +SKIP
        True
    """
    started = time.perf_counter()
    path = Path(path)
    fmt = format_for_output(path, format)
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    ckpt = Checkpoint.from_module(module, arch=arch, metadata=metadata)
    module = module.eval()
    options = WriteOptions(module=module, example_inputs=example_inputs, final_path=path)
    if FORMATS[fmt].has_graph and example_inputs is None and ckpt.arch is None:
        raise UnsupportedConversionError(type(module).__name__, fmt, "exporting a graph needs example_inputs "
                                         "(a tensor or tuple shaped like real inputs)")
    verify_result, size = write_verified(ckpt, path, fmt, options, force=force, verify=verify,
                                          module=module, sharded=False)
    return ConversionReport(
        source={"module": type(module).__name__, "arch": ckpt.arch.name if ckpt.arch else None},
        target={"path": str(path), "format": fmt, "bytes": size}, tensors=len(ckpt),
        parameters=ckpt.num_parameters, verify=verify_result, seconds=time.perf_counter() - started,
    )
