"""openvino: OpenVINO IR, a graph `m.xml` and its constants' bytes `m.bin`, written through OpenVINO's own
converter and run in OpenVINO's runtime.

Spec: https://docs.openvino.ai/2026/documentation/openvino-ir-format.html (IR v11), OpenVINO 2026.4. The
`openvino` extra brings the runtime; reading the weights needs neither it nor torch.

Writing: the module (options.module, else rebuilt from the ArchSpec) goes through `openvino.convert_model`
(OpenVINO's PyTorch frontend, on the example inputs; every axis left dynamic) and `openvino.save_model`
with `compress_to_fp16=False`, so the weights keep their dtype. Then each state_dict tensor is found among
the model's Const operations by its bytes and that Const is named `modelkit:<state_dict name>`; tensors the
graph no longer holds as such (OpenVINO folds a BatchNorm into the convolution before it, drops a
multiplication by a norm weight of ones) are appended after OpenVINO's data in the .bin. The model's
`rt_info` (kept in the .xml) records it all:

    <rt_info><modelkit>
      <names value='{"fc1.weight": {"const": "modelkit:fc1.weight", "dtype": "float32", "shape": [64, 2]},
                     "bn.running_var": {"from_end": 256, "dtype": "float32", "shape": [64]}, ...}'/>
      <arch value="ArchSpec JSON"/>  <metadata value="the Checkpoint's metadata as JSON"/>
    </modelkit></rt_info>

(`from_end`: where the tensor starts, counted back from the end of the .bin.) The write is verified as
every graph format's: the weights read back bit for bit, and OpenVINO's runtime (CPU, f32 inference
precision) against torch within the ONNX tolerance.

Reading: the .xml through modelkit.parse.openvino (no document type declarations, sizes capped, every
Const's offset and size checked against the .bin) behind the scanner's gate; tensors are views of the
mapped .bin. With modelkit's record, the state_dict names, shapes and ArchSpec come back; an IR from
elsewhere gives each Const of a dtype modelkit knows under its output's first tensor name (else its layer
name) and its IR shape. `runnable` compiles the IR with OpenVINO's runtime.

Telemetry: importing openvino (its model converter) sends usage events to Intel when the
`openvino-telemetry` package is installed and no opt-out file exists. modelkit downloads and uploads
nothing: before it imports openvino it makes `openvino_telemetry` unimportable in the process, so OpenVINO
uses its built-in stub (unless the process imported the telemetry package already).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from modelkit.checkpoint import ArchSpec, Checkpoint, LazyTensor, QuantizedTensor
from modelkit.errors import FormatError, MissingDependencyError, UnsupportedConversionError, reading
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.metadata import NAMES_KEY, json_object
from modelkit.parse import openvino as ir_xml
from modelkit.parse.detect import openvino as detect  # noqa: F401  (the converter's detect)
from modelkit.parse.paths import read_capped
from modelkit.storage.dtypes import DTYPES, tensor_bytes
from modelkit.storage.mapped import MappedFile
from modelkit.storage.write_behind import write_all

logger = logging.getLogger(__name__)

RT_INFO = "modelkit"              # rt_info/modelkit/{names, arch, metadata}
CONST_PREFIX = "modelkit:"        # the friendly name of a Const holding a state_dict tensor
DEVICE = "CPU"
# The runtime's settings for verification and evaluation: f32 arithmetic (the CPU plugin otherwise runs
# f32 models in bf16 on CPUs that have it: 2.3e-3 off torch on mlp, measured 2026-11-25).
COMPILE_CONFIG = {"INFERENCE_PRECISION_HINT": "f32"}


def openvino() -> ModuleType:
    """`import openvino` with its usage telemetry off (see the module docstring)."""
    if "openvino" not in sys.modules:
        sys.modules.setdefault("openvino_telemetry", None)      # a None entry: `import openvino_telemetry` fails
    try:
        import openvino as ov
    except ImportError as e:
        raise MissingDependencyError("writing and running OpenVINO IR needs the 'openvino' package: "
                                     "pip install 'modelkit[openvino]' (reading its weights does not)") from e
    return ov


def bin_path(path: Path) -> Path:
    """The weights file beside an IR .xml: m.xml -> m.bin (what OpenVINO reads by default)."""
    return path.with_suffix(".bin")


# ---------------------------------------------------------------------------------------------
# Reading

def _ir(path: Path) -> ir_xml.IR:
    with reading(path, "OpenVINO IR"):
        return ir_xml.read_ir(read_capped(path, ir_xml.MAX_XML, "an IR .xml"))


def read(path: Path, options: ReadOptions = ReadOptions()) -> Checkpoint:
    """The IR's weights as views of the mapped .bin; names, shapes and ArchSpec from modelkit's record."""
    from modelkit.scan import gate

    gate(path, trust=options.trust)
    ir = _ir(path)
    weights = bin_path(path)
    try:
        size = weights.stat().st_size if ir.consts else 0
    except OSError as e:
        raise FormatError(path, f"its weights file {weights.name} cannot be read ({e.strerror or e})") from e
    for const in ir.consts:
        problem = ir_xml.const_problem(const, size)
        if problem is not None:
            raise FormatError(weights, f"Const {const.layer.name[:80]!r} {problem}")
    mapped = MappedFile(weights) if ir.consts else None
    metadata = dict(json_object(path, f"rt_info {RT_INFO}/metadata", ir.rt_info.get(f"{RT_INFO}/metadata", "{}"),
                                what="the checkpoint's metadata"))
    metadata = {k: v for k, v in metadata.items() if isinstance(v, str)}
    arch_json = ir.rt_info.get(f"{RT_INFO}/arch")
    arch = ArchSpec.from_json(arch_json, source=path) if arch_json is not None else None
    record = ir.rt_info.get(f"{RT_INFO}/names")
    if record is None:
        tensors = _foreign(path, ir, mapped)
    else:
        names = json_object(path, NAMES_KEY, record, what="where each tensor lies")
        tensors = _recorded(path, ir, names, mapped, size)
    return Checkpoint(tensors=tensors, metadata=metadata, arch=arch)


def _view(mapped: MappedFile, offset: int, nbytes: int, dtype: Any, shape: tuple[int, ...], source: str) -> LazyTensor:
    return LazyTensor(dtype, shape, lambda: mapped.view(offset, nbytes, source).view(dtype.numpy).reshape(shape), source,
                      span=mapped.span(offset, nbytes))


def _recorded(path: Path, ir: ir_xml.IR, names: dict[str, Any], mapped: MappedFile | None,
              size: int) -> dict[str, LazyTensor]:
    consts = {c.layer.name: c for c in ir.consts if not c.layer.path}
    tensors: dict[str, LazyTensor] = {}
    for name, entry in names.items():
        dtype = DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if dtype is None or not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise FormatError(path, f"{NAMES_KEY} entry {name!r} has no known dtype and shape")
        shape = tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if "const" in entry:
            const = consts.get(entry["const"]) if isinstance(entry["const"], str) else None
            if const is None or const.dtype != dtype.name or const.size != nbytes:
                raise FormatError(path, f"{NAMES_KEY} entry {name!r} names no Const of {dtype.name} and {nbytes} bytes")
            offset = const.offset
        else:
            back = entry.get("from_end")
            if not isinstance(back, int) or isinstance(back, bool) or not nbytes <= back <= size:
                raise FormatError(path, f"{NAMES_KEY} entry {name!r} lies outside {bin_path(path).name}")
            offset = size - back
        if mapped is None:
            raise FormatError(path, f"{NAMES_KEY} names tensors, but the IR has no constants")
        tensors[name] = _view(mapped, offset, nbytes, dtype, shape, f"{path}:{name}")
    return tensors


def _foreign(path: Path, ir: ir_xml.IR, mapped: MappedFile | None) -> dict[str, LazyTensor]:
    """An IR modelkit did not write: each Const of a dtype modelkit knows, by its first tensor name."""
    tensors: dict[str, LazyTensor] = {}
    skipped = 0
    for const in ir.consts:
        if const.dtype is None or const.dtype not in DTYPES or mapped is None:
            skipped += 1
            continue
        name = const.layer.path + (const.names[0] if const.names else const.layer.name)
        if name in tensors:
            name = f"{name}#{const.layer.id}"
        tensors[name] = _view(mapped, const.offset, const.size, DTYPES[const.dtype], const.shape, f"{path}:{name}")
    if skipped:
        logger.info("%s: %d constants of packed or string element types are not read", path, skipped)
    return tensors


def runnable(path: Path, options: ReadOptions = ReadOptions()) -> Callable[..., Any]:
    """The IR compiled by OpenVINO's runtime (CPU, f32): a callable on torch tensors giving output 0."""
    import torch

    from modelkit.scan import gate

    gate(path, trust=options.trust)
    ov = openvino()
    core = ov.Core()
    try:
        compiled = core.compile_model(core.read_model(str(path), str(bin_path(path))), DEVICE, COMPILE_CONFIG)
    except RuntimeError as e:
        raise FormatError(path, f"OpenVINO cannot compile it ({_first_line(e)})") from e

    def run(*inputs: Any) -> torch.Tensor:
        arrays = [x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x) for x in inputs]
        return torch.from_numpy(np.array(compiled(arrays)[compiled.output(0)]))
    return run


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:200] if lines else type(error).__name__


# ---------------------------------------------------------------------------------------------
# Writing

def write(ckpt: Checkpoint, path: Path, options: WriteOptions = WriteOptions()) -> None:
    """convert_model, name the Consts that hold the checkpoint's tensors, save_model, append the rest."""
    from modelkit.checkpoint import instantiate

    for name, entry in ckpt.tensors.items():
        if isinstance(entry, QuantizedTensor):
            raise UnsupportedConversionError("quantized checkpoint", "openvino", f"tensor {name!r} is quantized "
                                             f"({entry.scheme}); dequantize it first")
    module = options.module
    if module is None:
        module = instantiate(ckpt, source="the checkpoint", target="openvino", dequantize=True)
    inputs = _example_inputs(module, options.example_inputs)
    ov = openvino()
    model = _convert(ov, module.eval(), inputs)
    names, tail = _place(model, ckpt)
    model.set_rt_info(json.dumps(names, separators=(",", ":")), [RT_INFO, "names"])
    model.set_rt_info(json.dumps(ckpt.metadata, separators=(",", ":")), [RT_INFO, "metadata"])
    if ckpt.arch is not None:
        model.set_rt_info(ckpt.arch.to_json(), [RT_INFO, "arch"])
    ov.save_model(model, str(path), compress_to_fp16=False)
    with bin_path(path).open("ab") as out:
        for name in tail:
            write_all(out, tensor_bytes(ckpt.tensors[name].array()))


def _example_inputs(module: Any, given: tuple[Any, ...] | None) -> tuple[Any, ...]:
    import torch

    if given is not None:
        return tuple(given)
    from modelkit.models import MODELS, load_model_module

    arch = getattr(type(module), "arch", None)
    if arch not in MODELS:
        raise UnsupportedConversionError(type(module).__name__, "openvino", "converting a graph needs example inputs "
                                         "shaped like real ones: pass --input-shape NAME=DIMS[:DTYPE] "
                                         "(API: example_inputs=...)")
    example = load_model_module(arch).example_inputs()
    dtype = next((p.dtype for p in module.parameters() if p.dtype.is_floating_point), torch.float32)
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in (example if isinstance(example, tuple) else (example,)))


def _convert(ov: ModuleType, module: Any, inputs: tuple[Any, ...]) -> Any:
    """openvino.convert_model on the example inputs (the tracer's deprecation and shape notes kept out of
    the user's way)."""
    import torch

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", category=DeprecationWarning)
        warnings.simplefilter("ignore", category=FutureWarning)
        warnings.simplefilter("ignore", category=torch.jit.TracerWarning)
        try:
            # Traced here without the tracer's re-run check (check_trace, 0.4 s of a 0.5 s trace of cnn): the
            # written IR's outputs are compared with the module's anyway.
            traced = torch.jit.trace(module, inputs, check_trace=False, strict=False)
            return ov.convert_model(traced, example_input=inputs if len(inputs) > 1 else inputs[0])
        except Exception as e:  # the converter raises its own OpConversionFailure, RuntimeError, ...
            raise UnsupportedConversionError(type(module).__name__, "openvino",
                                             f"openvino.convert_model failed ({_first_line(e)})") from e


def _place(model: Any, ckpt: Checkpoint) -> tuple[dict[str, Any], list[str]]:
    """Where each tensor lies: a Const of the same bytes (renamed modelkit:<name>), else the .bin's tail.
    Returns (the names record, the tail's tensors in order)."""
    by_bytes: dict[tuple[int, bytes], list[Any]] = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() == "Constant":
            data = np.ascontiguousarray(op.get_data()).reshape(-1).view(np.uint8)
            by_bytes.setdefault((data.size, hashlib.sha1(data).digest()), []).append(op)
    names: dict[str, Any] = {}
    tail: list[tuple[str, int]] = []
    owner: dict[int, str] = {}                          # id(op) -> the Const's new name
    for name, entry in ckpt.tensors.items():
        data = tensor_bytes(entry.array())
        spec = {"dtype": entry.dtype.name, "shape": list(entry.shape)}
        match = next((op for op in by_bytes.get((len(data), hashlib.sha1(data).digest()), [])
                      if _element_type(op) == entry.dtype.name), None)
        if match is None:
            tail.append((name, len(data)))
            names[name] = spec
            continue
        if id(match) not in owner:
            owner[id(match)] = f"{CONST_PREFIX}{name}"
            match.set_friendly_name(owner[id(match)])
        names[name] = {"const": owner[id(match)], **spec}
    remaining = sum(n for _, n in tail)
    for name, nbytes in tail:                          # appended in this order: the first lies furthest from the end
        names[name]["from_end"] = remaining
        remaining -= nbytes
    return names, [name for name, _ in tail]


def _element_type(op: Any) -> str | None:
    return ir_xml.ELEMENT_TYPES.get(op.get_output_element_type(0).get_type_name(), (None, 0))[0]
