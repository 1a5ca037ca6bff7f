"""OpenVINO IR: the .xml's operations and the .bin's bounds.

An IR holds no pickles and no code of its own: every operation is a C++ kernel of the runtime. What it can
carry that runs outside OpenVINO's own code is an operation from an extension (a `version` that is not one of
OpenVINO's operation sets): it runs only when the loader registers a shared library implementing it
(`core.add_extension(...)`), native code outside the file, as an ONNX custom domain does. A document type
declaration (entities: expansion bombs, outside files) is never in an IR and is dangerous. Constants whose
bytes lie past the end of the .bin (or that the .bin cannot hold) are reported; the .bin is recorded as the
model's tensor data, scanned by content like every file. Standard library only.
"""
from __future__ import annotations

import os

from modelkit.errors import ParseError
from modelkit.parse import openvino as ir_xml
from modelkit.scan.model import Severity

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from modelkit.scan.containers import Context

_MAX_FINDINGS = 100


def scan_ir(buf, start: int, end: int, ctx: Context, label: str) -> str:
    """Judge an IR .xml; returns the format name ("openvino")."""
    sink = ctx.sink(label)
    try:
        ir = ir_xml.read_ir(buf[start:end])
    except ParseError as e:
        rule = "openvino.xml.entities" if "document type" in e.reason else "openvino.malformed"
        sink.add(Severity.DANGEROUS if rule == "openvino.xml.entities" else Severity.SUSPICIOUS, rule,
                 f"the IR cannot be read as OpenVINO reads it: {e.reason}")
        return "openvino"
    custom = ir_xml.custom_layers(ir)
    for layer in custom[:_MAX_FINDINGS]:
        sink.add(Severity.SUSPICIOUS, "openvino.custom_op",
                 f"layer {layer.name[:80]!r} is a {layer.type[:80]} of operation set {layer.version[:80]!r}, not one "
                 "of OpenVINO's: it runs only with an extension library the loader registers (native code outside "
                 "the file)", name=f"{layer.version[:80]}.{layer.type[:80]}")
    weights = "weights not checked (not on disk)"
    if ctx.depth == 0 and ctx.directory is not None and label.lower().endswith(".xml"):
        bin_path = os.path.join(ctx.directory, os.path.basename(label)[:-4] + ".bin")
        if os.path.isfile(bin_path):
            size = os.path.getsize(bin_path)
            problems = [(c, p) for c in ir.consts for p in [ir_xml.const_problem(c, size)] if p]
            for const, problem in problems[:_MAX_FINDINGS]:
                sink.add(Severity.SUSPICIOUS, "openvino.const.bounds", f"Const {const.layer.name[:80]!r} {problem}",
                         name=const.layer.name[:80])
            ctx.data_files.append(os.path.realpath(bin_path))
            weights = f"{len(ir.consts)} constants checked against {os.path.basename(bin_path)}"
        elif ir.consts:
            sink.add(Severity.SUSPICIOUS, "openvino.bin.missing",
                     f"the IR's {len(ir.consts)} constants need {os.path.basename(bin_path)}, which is not beside it")
    ctx.examined.append(f"{label}: OpenVINO IR v{ir.version}, {len(ir.layers)} layers ({len(custom)} from "
                        f"extensions), {weights}")
    return "openvino"
