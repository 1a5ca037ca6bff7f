"""Quantize ONNX models with onnxruntime's own tools, then run both sessions to check the result.

- int8-dynamic: `onnxruntime.quantization.quantize_dynamic` (int8 weights per channel;
  MatMulInteger / ConvInteger with activations quantized at run time).
- int8-static: `quantize_static` in QDQ format, activation ranges calibrated (MinMax) on the
  reference model's own training data through a CalibrationDataReader.
- int4: `MatMulNBitsQuantizer` (4-bit blocks of `group_size` along K, symmetric, fp scales):
  MatMulNBits nodes. Gemm nodes (how the exporter writes nn.Linear with a batch-only input) are
  rewritten as MatMul + Add first so they qualify.

The torch exporter's graphs carry shape annotations (`value_info`) that onnxruntime's
quantizer re-infers and then rejects as inconsistent ("Inferred shape and existing shape
differ"); they are dropped first and re-inferred, so that failure never reaches the user. The
output keeps the source's metadata (ArchSpec, metrics) except the state_dict name map, which no
longer fits the rewritten initializers, and records the scheme under "modelkit.quantization".
"""
from __future__ import annotations

import fnmatch
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from modelkit.checkpoint import ARCH_KEY, ArchSpec
from modelkit.errors import ConfigError, FormatError, UnsupportedConversionError, did_you_mean
from modelkit.formats import FORMATS
from modelkit.metadata import NAMES_KEY, QUANT_KEY
from modelkit.pipeline.write import write_output
from modelkit.schemes import ONNX_SCHEMES
from modelkit.testing import compare_outputs

PathLike = str | os.PathLike[str]
logger = logging.getLogger(__name__)
# Largest relative output difference (max |float - quantized| / max |float|) on the sample inputs.
# Measured on the trained zoo on 2026-11-21 (cnn / tinylm): int8-dynamic 0.012 / 0.071,
# int8-static 0.019 / 0.174, int4 0.060 / 0.237; pinned with 2.5-3x headroom.
RELATIVE_TOLERANCE = {"int8-dynamic": 0.2, "int8-static": 0.5, "int4": 0.6}


class _ZooReader:
    """CalibrationDataReader: batches of the reference model's training inputs, by input name."""

    def __init__(self, arch: ArchSpec, input_name: str, *, samples: int, batch_size: int = 16, seed: int = 0) -> None:
        from modelkit.models import build_from_spec
        from modelkit.quantizers.gptq import calibration_batches

        batches = calibration_batches(build_from_spec(arch), samples=samples, batch_size=batch_size, seed=seed)
        self._feeds = iter([{input_name: b.numpy()} for b in batches])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)

    def rewind(self) -> None:   # onnxruntime >= 1.17 calls it between calibration passes
        pass


def _load(src: Path) -> Any:
    import onnx

    try:
        model = onnx.load(str(src), load_external_data=False)
    except Exception as e:   # protobuf raises its own DecodeError; onnx wraps others
        raise FormatError(src, f"not a readable ONNX model ({e})") from e
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        raise UnsupportedConversionError(src.name, "quantized onnx", "models with external data are not supported yet")
    return model


def _arch(model: Any, src: Path) -> ArchSpec:
    props = {p.key: p.value for p in model.metadata_props}
    if ARCH_KEY not in props:
        raise UnsupportedConversionError(src.name, "quantized onnx", "calibration data, checks and metrics need a "
                                         "model written by modelkit (it records its ArchSpec)")
    return ArchSpec.from_json(props[ARCH_KEY], source=src)


def _prepare(model: Any, folder: Path) -> Any:
    """Drop the exporter's intermediate shape annotations, then let onnxruntime's pre-processing
    infer fresh ones (shape inference only: no graph rewrites, so node names stay as they were)."""
    import onnx
    from onnxruntime.quantization.shape_inference import quant_pre_process

    del model.graph.value_info[:]
    raw, prepared = folder / "clean.onnx", folder / "prepared.onnx"
    onnx.save(model, str(raw))
    try:
        quant_pre_process(str(raw), str(prepared), skip_optimization=True)
    except Exception as e:      # its symbolic shape inference raises many types; the cleaned model still works
        logger.info("onnxruntime pre-processing failed (%s); quantizing the cleaned model", e)
        return model
    return onnx.load(str(prepared))


def _gemm_to_matmul(model: Any) -> int:
    """Gemm(A, W, C; transB) with initializer W -> MatMul(A, W^T) + Add(C): what MatMulNBits takes."""
    from onnx import helper, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    nodes, changed = [], 0
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        plain = attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0 and not attrs.get("transA", 0)
        if node.op_type != "Gemm" or not plain or node.input[1] not in inits:
            nodes.append(node)
            continue
        weight = numpy_helper.to_array(inits[node.input[1]])
        if attrs.get("transB", 0):
            weight = weight.T
        name = f"{node.input[1]}_kn"
        model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weight), name))
        product = f"{node.output[0]}_matmul" if len(node.input) > 2 and node.input[2] else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], name], [product], name=f"{node.name}_matmul"))
        if product != node.output[0]:
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]], name=f"{node.name}_add"))
        changed += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {i for n in model.graph.node for i in n.input}
    keep = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    return changed


def _excluded_nodes(model: Any, skip: Sequence[str]) -> list[str]:
    """Nodes whose weight belongs to a module matching a skip pattern (through modelkit's name map)."""
    if not skip:
        return []
    props = {p.key: p.value for p in model.metadata_props}
    names = json.loads(props.get(NAMES_KEY, "{}"))
    initializers = {entry["initializer"] for sd, entry in names.items() if isinstance(entry, dict)
                    and any(fnmatch.fnmatchcase(sd.rpartition(".")[0], p) for p in skip)}
    initializers |= {t.name for t in model.graph.initializer
                     if any(fnmatch.fnmatchcase(t.name.rpartition(".")[0], p) for p in skip)}
    return [n.name for n in model.graph.node if initializers & set(n.input)]


def _quantize(model: Any, scheme: str, arch: ArchSpec, *, group_size: int, exclude: list[str], tmp: Path,
              calibration_samples: int) -> Any:
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    if scheme == "int4":
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        _gemm_to_matmul(model)
        quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=group_size, is_symmetric=True,
                                         nodes_to_exclude=exclude or None)
        quantizer.process()
        return quantizer.model.model
    out = tmp / "quantized.onnx"
    common = {"per_channel": True, "weight_type": QuantType.QInt8, "nodes_to_exclude": exclude or None}
    if scheme == "int8-dynamic":
        quantize_dynamic(model, out, **common)
    else:
        reader = _ZooReader(arch, model.graph.input[0].name, samples=calibration_samples)
        # Weight-bearing ops only: activation x activation products (attention) lose too much at int8.
        quantize_static(model, out, reader, quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8,
                        op_types_to_quantize=["MatMul", "Gemm", "Conv"], extra_options={"MatMulConstBOnly": True},
                        **common)
    return onnx.load(str(out))


def quantize_onnx(src: PathLike, dst: PathLike | None, *, scheme: str, group_size: int | None = None,
                  skip: Sequence[str] = (), evaluate: bool = False, latency: bool | None = None, verify: bool = True,
                  force: bool = False, reference: dict[str, Any] | None = None, calibration_samples: int = 128) -> Any:
    """Quantize an ONNX model written by modelkit; returns a QuantizeReport (see modelkit.pipeline.quantize)."""
    import onnx

    from modelkit.pipeline.reports import QuantizeReport

    if not isinstance(scheme, str) or scheme not in ONNX_SCHEMES:
        raise ConfigError(f"unknown scheme {scheme!r} for ONNX models; known: {', '.join(ONNX_SCHEMES)}"
                          f"{did_you_mean(str(scheme), ONNX_SCHEMES)}")
    if dst is None:
        raise ConfigError("ONNX quantization needs an output path")
    src, dst = Path(src), Path(dst)
    model = _load(src)
    arch = _arch(model, src)
    group = group_size or 32
    if scheme != "int4" and group_size is not None:
        raise ConfigError(f"--group-size applies to int4, not {scheme}")
    if group not in (16, 32, 64, 128, 256):
        raise ConfigError(f"int4 group_size must be a power of two from 16 to 256, got {group}")
    source_props = [(p.key, p.value) for p in model.metadata_props if p.key != NAMES_KEY]
    params = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
    exclude = _excluded_nodes(model, skip)
    started = time.perf_counter()
    quiet = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = quiet.level
    quiet.setLevel(logging.WARNING)         # it logs every node at INFO
    try:
        with tempfile.TemporaryDirectory() as folder:
            model = _prepare(model, Path(folder))
            quantized = _quantize(model, scheme, arch, group_size=group, exclude=exclude, tmp=Path(folder),
                                  calibration_samples=calibration_samples)
    finally:
        quiet.setLevel(level)
    seconds = time.perf_counter() - started
    del quantized.metadata_props[:]
    for key, value in source_props:
        quantized.metadata_props.add(key=key, value=value)
    config = {"scheme": scheme, "tool": "onnxruntime", **({"group_size": group} if scheme == "int4" else {})}
    quantized.metadata_props.add(key=QUANT_KEY, value=json.dumps(config, sort_keys=True))

    def write(tmp: Path) -> None:
        onnx.save(quantized, str(tmp))
        onnx.checker.check_model(str(tmp))

    check, size = write_output(dst, write, verify=(lambda tmp: check_sessions(src, tmp, arch, scheme)) if verify else None,
                               force=force, companions=FORMATS["onnx"].companions)
    measured = measure_sessions(src, dst, arch, evaluate=evaluate, latency=bool(latency or evaluate), reference=reference)
    report = QuantizeReport(scheme=scheme, config=config, source={"path": str(src), "format": "onnx",
                            "bytes": src.stat().st_size}, target={"path": str(dst), "format": "onnx", "bytes": size},
                            stats={"parameters": params, "bits_per_weight": round(8 * size / max(params, 1), 3)},
                            seconds_quantize=round(seconds, 3), size_ratio=round(size / src.stat().st_size, 4),
                            verify=check, notes=[f"{len(exclude)} node(s) kept in float by --skip"] if exclude else [])
    report.metric, report.latency_ms = measured
    return report


def check_sessions(src: Path, quantized: Path, arch: ArchSpec, scheme: str, *, fmt: str = "onnx",
           bound: float | None = None) -> dict[str, Any]:
    """Run the float and the quantized session on seeded inputs; their outputs must stay close
    (within RELATIVE_TOLERANCE[scheme], or `bound`, of the largest float output)."""
    from modelkit.pipeline.measure import session_module
    from modelkit.pipeline.verify import sample_inputs

    reference, candidate = session_module(src, arch, fmt), session_module(quantized, arch, fmt)
    bound = RELATIVE_TOLERANCE[scheme] if bound is None else bound
    result = compare_outputs(reference, candidate, sample_inputs(reference, batches=(1, 4)), rtol=bound,
                             label=f"{quantized} (quantized session against the float one)")
    return {**result, "method": "both sessions", "bound": bound}


def measure_sessions(src: Path, quantized: Path, arch: ArchSpec, *, evaluate: bool, latency: bool,
             reference: dict[str, Any] | None, fmt: str = "onnx") -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    from modelkit.models import load_model_module
    from modelkit.pipeline import measure

    metric = lat = None
    float_session, quant_session = measure.session_module(src, arch, fmt), measure.session_module(quantized, arch, fmt)
    if evaluate:
        task = load_model_module(arch.name).TASK
        before = (reference or {}).get("metric") or measure.evaluate(float_session, device="cpu")
        after = measure.evaluate(quant_session, device="cpu")
        metric = measure.metric_change(task.metric, task.higher_is_better, before, after)
    if latency:
        lat = {kind: measure.latencies(session) for kind, session in (("float", float_session),
                                                                      ("quantized", quant_session))}
    return metric, lat


def float_reference(src: PathLike) -> dict[str, Any]:
    """The float ONNX model's metric, measured once for a comparison run."""
    from modelkit.pipeline.measure import evaluate, session_module

    src = Path(src)
    arch = _arch(_load(src), src)
    return {"metric": evaluate(session_module(src, arch), device="cpu")}
