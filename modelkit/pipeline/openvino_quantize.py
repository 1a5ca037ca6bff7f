"""Quantize OpenVINO IRs with OpenVINO's own tool, NNCF, then run both in OpenVINO's runtime to check the result.

- int8: `nncf.compress_weights(model, mode=INT8_ASYM)`: every weight of a MatMul, Convolution or Gather
  becomes uint8 per output channel with a float16 scale and zero point, decompressed in the graph as the
  runtime reads it (weight-only: activations stay float, no calibration data).

The input is an IR modelkit wrote (its rt_info records the ArchSpec, needed for the checks and metrics);
the output keeps the ArchSpec and metadata, drops the names record (its constants are now the compressed
ones) and records the scheme under rt_info modelkit/quantization. NNCF's own logging and progress display
are kept off the user's terminal; its telemetry is off with OpenVINO's (modelkit.converters.openvino).
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from modelkit.checkpoint import ArchSpec
from modelkit.errors import ConfigError, MissingDependencyError, UnsupportedConversionError, did_you_mean
from modelkit.formats import FORMATS, ReadOptions, load_format
from modelkit.pipeline.onnx_quantize import check_sessions, measure_sessions
from modelkit.pipeline.write import write_output

PathLike = str | os.PathLike[str]
OPENVINO_SCHEMES: tuple[str, ...] = ("int8",)
# Largest relative output difference (max |float - quantized| / max |float|) on the sample inputs, as ONNX's
# int8-dynamic: 0.2 (measured on seeded zoo models, 2026-11-25: docs/formats/openvino.md).
RELATIVE_TOLERANCE = {"int8": 0.2}
RT_INFO = "modelkit"


def _nncf() -> Any:
    load_format("openvino").openvino()           # telemetry off before NNCF looks for it
    try:
        import nncf
    except ImportError as e:
        raise MissingDependencyError(f"OpenVINO quantization needs the {e.name!r} package: "
                                     "pip install 'modelkit[nncf]'") from e
    return nncf


def quantize_openvino(src: PathLike, dst: PathLike | None, *, scheme: str, group_size: int | None = None,
                      skip: tuple[str, ...] = (), evaluate: bool = False, latency: bool | None = None,
                      verify: bool = True, force: bool = False, reference: dict[str, Any] | None = None) -> Any:
    """Quantize an OpenVINO IR written by modelkit; returns a QuantizeReport (see modelkit.pipeline.quantize)."""
    from modelkit.pipeline.reports import QuantizeReport

    if not isinstance(scheme, str) or scheme not in OPENVINO_SCHEMES:
        raise ConfigError(f"unknown scheme {scheme!r} for OpenVINO IRs; known: {', '.join(OPENVINO_SCHEMES)}"
                          f"{did_you_mean(str(scheme), OPENVINO_SCHEMES)}")
    if dst is None:
        raise ConfigError("OpenVINO quantization needs an output path (.xml)")
    if group_size is not None or skip:
        raise ConfigError("--group-size and --skip do not apply to OpenVINO's int8 weight compression")
    src, dst = Path(src), Path(dst)
    converter = load_format("openvino")
    float_ckpt = converter.read(src, ReadOptions())
    if float_ckpt.arch is None:
        raise UnsupportedConversionError(src.name, "quantized openvino", "calibration of the checks and metrics needs "
                                         "an IR written by modelkit (it records its ArchSpec)")
    arch: ArchSpec = float_ckpt.arch
    nncf = _nncf()
    ov = converter.openvino()
    model = ov.Core().read_model(str(src), str(converter.bin_path(src)))
    started = time.perf_counter()
    quiet = logging.getLogger("nncf")
    level = quiet.level
    quiet.setLevel(logging.WARNING)              # its bit-width table, at INFO, on stdout
    try:
        with contextlib.redirect_stdout(io.StringIO()):     # its progress bar
            compressed = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    finally:
        quiet.setLevel(level)
    seconds = time.perf_counter() - started
    config = {"scheme": scheme, "tool": "nncf", "mode": "int8_asym", "granularity": "per-channel"}
    del compressed.rt_info[RT_INFO]                # its names record lists float constants that are gone
    compressed.set_rt_info(arch.to_json(), [RT_INFO, "arch"])
    compressed.set_rt_info(json.dumps(float_ckpt.metadata, separators=(",", ":")), [RT_INFO, "metadata"])
    compressed.set_rt_info(json.dumps(config, sort_keys=True), [RT_INFO, "quantization"])

    def write(tmp: Path) -> None:
        ov.save_model(compressed, str(tmp), compress_to_fp16=False)

    bound = RELATIVE_TOLERANCE[scheme]
    check, size = write_output(
        dst, write, force=force, companions=FORMATS["openvino"].companions,
        verify=(lambda tmp: check_sessions(src, tmp, arch, scheme, fmt="openvino", bound=bound)) if verify else None)
    bin_size = converter.bin_path(dst).stat().st_size
    source_bytes = src.stat().st_size + converter.bin_path(src).stat().st_size
    size += bin_size
    measured = measure_sessions(src, dst, arch, evaluate=evaluate, latency=bool(latency or evaluate),
                                reference=reference, fmt="openvino")
    params = float_ckpt.num_parameters
    report = QuantizeReport(scheme=scheme, config=config, source={"path": str(src), "format": "openvino",
                            "bytes": source_bytes}, target={"path": str(dst), "format": "openvino", "bytes": size},
                            stats={"parameters": params, "bits_per_weight": round(8 * bin_size / max(params, 1), 3)},
                            seconds_quantize=round(seconds, 3), size_ratio=round(size / source_bytes, 4), verify=check)
    report.metric, report.latency_ms = measured
    return report
