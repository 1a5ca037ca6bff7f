"""OpenVINO IR: the `.xml` graph (layers, edges, rt_info) and where each constant's bytes lie in its `.bin`.

Spec: https://docs.openvino.ai/2026/documentation/openvino-ir-format/operation-sets.html and the IR
serializer (src/core/src/pass/serialize.cpp), IR version 10 and 11. The XML is

    <net name version="11">
      <layers>
        <layer id name type version="opset1"> <data element_type="f32" shape="30, 2" offset="0" size="240"/>
                                               <output><port id names="...">...</port></output>
          (Loop, TensorIterator, If: a <body> / <then_body> / <else_body> with <layers> of its own)
      </layers>
      <edges> ... </edges>
      <rt_info> <name value="..."/> or nested elements </rt_info>
    </net>

and the .bin is the Const layers' bytes, each at its `offset`, `size` bytes long, little-endian, in the
element type's packing. Parsed with the standard library's expat (xml.etree): a document type declaration
(the only way an XML file names entities or outside files) is refused before parsing, sizes and counts are
capped, and every Const's offset and size is checked against the .bin (`const_problem`). Standard library only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from modelkit.errors import ParseError

MAX_XML = 1 << 30                  # bytes of XML read: far above the largest IRs (a 70B LLM's is ~30 MB)
MAX_LAYERS = 10_000_000
HEAD = 4096                        # bytes detection reads
# element type -> (numpy-style dtype name modelkit knows, bits per element); packed sub-byte types have no name
ELEMENT_TYPES: dict[str, tuple[str | None, int]] = {
    "f64": ("float64", 64), "f32": ("float32", 32), "f16": ("float16", 16), "bf16": ("bfloat16", 16),
    "i64": ("int64", 64), "i32": ("int32", 32), "i16": ("int16", 16), "i8": ("int8", 8),
    "u64": ("uint64", 64), "u32": ("uint32", 32), "u16": ("uint16", 16), "u8": ("uint8", 8),
    "boolean": ("bool", 8), "f8e4m3": ("float8_e4m3fn", 8), "f8e5m2": ("float8_e5m2", 8),
    "u4": (None, 4), "i4": (None, 4), "nf4": (None, 4), "u2": (None, 2), "u1": (None, 1), "f4e2m1": (None, 4),
    "u3": (None, 3), "u6": (None, 6), "string": (None, 0),
}
# The opsets OpenVINO's own operations belong to; any other `version` is an extension's (custom) operation.
STANDARD_OPSETS = re.compile(r"opset\d{1,3}|internal|experimental")
_DOCTYPE = re.compile(r"<!\s*(DOCTYPE|ENTITY)", re.IGNORECASE)
_BODIES = ("body", "then_body", "else_body")


@dataclass(frozen=True)
class Layer:
    id: str
    name: str
    type: str
    version: str
    path: str                      # "" at the top; "<loop layer name>/body" inside a sub-graph


@dataclass(frozen=True)
class Const:
    layer: Layer
    element_type: str
    shape: tuple[int, ...]
    offset: int
    size: int
    names: tuple[str, ...]         # the output port's tensor names

    @property
    def dtype(self) -> str | None:
        """modelkit's dtype name of the element type, None for packed or string types."""
        return ELEMENT_TYPES.get(self.element_type, (None, 0))[0]

    @property
    def expected_size(self) -> int | None:
        bits = ELEMENT_TYPES.get(self.element_type, (None, 0))[1]
        if not bits:
            return None
        count = 1
        for d in self.shape:
            count *= d
        return (count * bits + 7) // 8


@dataclass
class IR:
    version: int
    name: str
    layers: list[Layer] = field(default_factory=list)
    consts: list[Const] = field(default_factory=list)
    rt_info: dict[str, str] = field(default_factory=dict)      # "a/b" -> value, for every leaf with a value


def looks_like_ir(head: bytes) -> bool:
    """The first bytes of an IR .xml: an XML document whose root element is <net ...> (after the XML
    declaration, comments, processing instructions and a document type declaration, which the reader refuses)."""
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    for _ in range(64):
        if text.startswith((b"<?", b"<!--")):
            end = text.find(b"?>" if text.startswith(b"<?") else b"-->")
            text = text[end + (2 if text.startswith(b"<?") else 3):].lstrip() if end >= 0 else b""
        elif text[:9].upper() == b"<!DOCTYPE":
            bracket, close = text.find(b"["), text.find(b">")
            end = text.find(b"]>") + 1 if 0 <= bracket < close else close
            text = text[end + 1:].lstrip() if end > 0 else b""
        else:
            break
    return text[:5] in (b"<net ", b"<net>", b"<net\n", b"<net\t", b"<net\r")


def read_ir(buf) -> IR:
    """The layers, constants and rt_info of an IR .xml in `buf`.

    Raises:
        ParseError: over MAX_XML, a document type declaration, malformed XML, a root that is not <net>, an
            IR version other than 10 or 11, a Const without a well-formed element type, shape, offset or size,
            or more than MAX_LAYERS layers.
    """
    import xml.etree.ElementTree as ET

    if len(buf) > MAX_XML:
        raise ParseError(f"IR XML larger than {MAX_XML} bytes is not read")
    try:
        text = bytes(buf).decode("utf-8")          # the only encoding OpenVINO writes; the check below reads it
    except UnicodeDecodeError as e:
        raise ParseError(f"the XML is not UTF-8 (byte {e.start})") from None
    if _DOCTYPE.search(text):
        raise ParseError("the XML declares a document type or entities, which an OpenVINO IR never does "
                         "(entity expansion and outside files)")
    try:
        root = ET.fromstring(text)
    except (ET.ParseError, ValueError, RecursionError) as e:
        raise ParseError(f"not well-formed XML ({e})") from None
    if root.tag != "net":
        raise ParseError(f"the root element is <{root.tag[:40]}>, not an OpenVINO IR's <net>")
    try:
        version = int(root.get("version", ""))
    except ValueError:
        raise ParseError(f"IR version {root.get('version', '')[:20]!r} is not a number") from None
    if version not in (10, 11):
        raise ParseError(f"IR version {version}; modelkit reads versions 10 and 11")
    ir = IR(version, root.get("name", ""))
    _layers(root, "", ir, 0)
    info = root.find("rt_info")
    if info is not None:
        _rt_info(info, "", ir.rt_info)
    return ir


def _layers(graph, path: str, ir: IR, depth: int) -> None:
    if depth > 32:
        raise ParseError("sub-graphs nested deeper than 32")
    layers = graph.find("layers")
    for element in layers if layers is not None else ():
        if element.tag != "layer":
            continue
        if len(ir.layers) >= MAX_LAYERS:
            raise ParseError(f"more than {MAX_LAYERS} layers")
        layer = Layer(element.get("id", ""), element.get("name", ""), element.get("type", ""),
                      element.get("version", ""), path)
        ir.layers.append(layer)
        if layer.type == "Const":
            ir.consts.append(_const(layer, element))
        for body in _BODIES:
            sub = element.find(body)
            if sub is not None:
                _layers(sub, f"{path}{layer.name}/{body}/", ir, depth + 1)


def _const(layer: Layer, element) -> Const:
    data = element.find("data")
    if data is None:
        raise ParseError(f"Const layer {layer.name[:80]!r} has no <data>")
    element_type = data.get("element_type", "")
    if element_type not in ELEMENT_TYPES:
        raise ParseError(f"Const layer {layer.name[:80]!r} has element type {element_type[:20]!r}")
    shape_text = data.get("shape", "").strip()
    try:
        shape = tuple(int(d) for d in shape_text.split(",")) if shape_text else ()
        offset, size = int(data.get("offset", "")), int(data.get("size", ""))
    except ValueError:
        raise ParseError(f"Const layer {layer.name[:80]!r} has a shape, offset or size that is not a number") from None
    if any(d < 0 for d in shape) or offset < 0 or size < 0:
        raise ParseError(f"Const layer {layer.name[:80]!r} has a negative shape, offset or size")
    port = element.find("output/port")
    names = tuple(n.strip() for n in (port.get("names", "") if port is not None else "").split(",") if n.strip())
    return Const(layer, element_type, shape, offset, size, names)


def _rt_info(element, prefix: str, out: dict[str, str]) -> None:
    for child in element:
        key = f"{prefix}{child.get('name', child.tag)}"
        value = child.get("value")
        if value is not None:
            out[key] = value
        _rt_info(child, f"{key}/", out)


def const_problem(const: Const, bin_size: int) -> str | None:
    """Why a Const's bytes cannot be read from a .bin of `bin_size` bytes, or None."""
    if const.offset + const.size > bin_size:
        return f"lies at bytes {const.offset}..{const.offset + const.size}, past the end of the .bin ({bin_size} bytes)"
    expected = const.expected_size
    if expected is not None and expected != const.size:
        return f"is {const.size} bytes, but {const.element_type} {list(const.shape)} takes {expected}"
    return None


def custom_layers(ir: IR) -> list[Layer]:
    """Layers whose operation set is not one of OpenVINO's own: an extension (a shared library the runner
    must load) implements them."""
    return [layer for layer in ir.layers if not STANDARD_OPSETS.fullmatch(layer.version)]
