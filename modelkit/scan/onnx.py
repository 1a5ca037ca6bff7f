"""ONNX: a bounded protobuf wire-format walk over ModelProto for external data paths and operator domains.

Only the fields that matter are followed (onnx/onnx.proto field numbers below); tensor bytes
(`raw_data`) are length-delimited fields that are skipped, never read. External data must resolve
inside the model's folder: an absolute path, a '..' component or a symlink that leaves the folder
lets a model read (and a converter copy out) any file on the machine. Standard library only.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from modelkit.scan.model import Severity

if TYPE_CHECKING:
    from modelkit.scan.containers import Context

# Field numbers (onnx.proto).
MODEL = {"opset_import": 8, "graph": 7, "training_info": 20, "functions": 25}
GRAPH = {"node": 1, "initializer": 5, "sparse_initializer": 15}
NODE = {"op_type": 4, "domain": 7, "attribute": 5}
ATTRIBUTE = {"t": 5, "g": 6, "tensors": 10, "graphs": 11, "sparse_tensor": 22, "sparse_tensors": 23}
TENSOR = {"name": 8, "external_data": 13, "data_location": 14}
SPARSE = {"values": 1, "indices": 2}
FUNCTION = {"name": 1, "node": 7, "opset_import": 9, "domain": 10}
TRAINING = {"initialization": 1, "algorithm": 2}
_MODEL_FIELDS = {1, 2, 3, 4, 5, 6, 7, 8, 14, 20, 21, 25, 26}

STANDARD_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "ai.onnx.training", "ai.onnx.preview.training",
                              "com.microsoft", "com.microsoft.nchwc", "com.microsoft.experimental",
                              "com.ms.internal.nhwc", "org.pytorch.aten"})
MAX_DEPTH = 32
_DOMAIN_RE = re.compile(r"[A-Za-z0-9_.\-]{1,200}\Z")


class _WireError(Exception):
    pass


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    for _ in range(10):
        if pos >= end:
            raise _WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise _WireError("varint longer than 10 bytes")


def fields(buf, pos: int, end: int):
    """Yield (field number, wire type, value or (start, stop) for length-delimited) within buf[pos:end]."""
    while pos < end:
        tag, pos = _varint(buf, pos, end)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise _WireError("field number 0")
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield number, wire, value
        elif wire == 1 or wire == 5:
            size = 8 if wire == 1 else 4
            if pos + size > end:
                raise _WireError("truncated fixed-width field")
            yield number, wire, None
            pos += size
        elif wire == 2:
            length, pos = _varint(buf, pos, end)
            if length > end - pos:
                raise _WireError(f"a field claims {length} bytes, {end - pos} remain")
            yield number, wire, (pos, pos + length)
            pos += length
        else:
            raise _WireError(f"wire type {wire} (groups or invalid)")


def looks_like_onnx(buf, start: int, end: int) -> bool:
    """A ModelProto at top level: only ModelProto field numbers, an ir_version and a graph or opset."""
    if end - start < 4 or buf[start] != 0x08:
        return False
    seen = set()
    try:
        for count, (number, wire, _) in enumerate(fields(buf, start, end)):
            if number not in _MODEL_FIELDS or count > 10_000:
                return False
            if number == 1 and wire != 0:
                return False
            seen.add(number)
    except _WireError:
        return False
    return 1 in seen and (7 in seen or 8 in seen)


def _text(buf, span) -> str:
    return bytes(buf[span[0]:span[1]]).decode("utf-8", "replace")


class _Walk:
    def __init__(self, buf, ctx: Context, label: str) -> None:
        self.buf, self.ctx, self.label = buf, ctx, label
        self.sink = ctx.sink(label)
        self.local_domains: set[str] = set()
        self.domains_used: set[str] = set()
        self.nodes = self.tensors = self.external = 0

    def model(self, start: int, end: int) -> None:
        graphs, functions = [], []
        for number, wire, value in fields(self.buf, start, end):
            if wire != 2:
                continue
            if number == MODEL["opset_import"]:
                for n, w, v in fields(self.buf, *value):
                    if n == 1 and w == 2:
                        self.domain(_text(self.buf, v), "opset_import")
            elif number == MODEL["graph"]:
                graphs.append(value)
            elif number == MODEL["functions"]:
                functions.append(value)
            elif number == MODEL["training_info"]:
                graphs += [v for n, w, v in fields(self.buf, *value) if w == 2 and n in TRAINING.values()]
        for span in functions:      # local functions define domains that nodes may then use
            for n, w, v in fields(self.buf, *span):
                if n == FUNCTION["domain"] and w == 2:
                    self.local_domains.add(_text(self.buf, v))
        for span in functions:
            for n, w, v in fields(self.buf, *span):
                if n == FUNCTION["node"] and w == 2:
                    self.node(v, 1)
        for span in graphs:
            self.graph(span, 1)

    def graph(self, span, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise _WireError(f"subgraphs nested deeper than {MAX_DEPTH}")
        for number, wire, value in fields(self.buf, *span):
            if wire != 2:
                continue
            if number == GRAPH["node"]:
                self.node(value, depth)
            elif number == GRAPH["initializer"]:
                self.tensor(value)
            elif number == GRAPH["sparse_initializer"]:
                self.sparse(value)

    def node(self, span, depth: int) -> None:
        self.nodes += 1
        domain, op_type = "", ""
        for number, wire, value in fields(self.buf, *span):
            if wire != 2:
                continue
            if number == NODE["domain"]:
                domain = _text(self.buf, value)
            elif number == NODE["op_type"]:
                op_type = _text(self.buf, value)
            elif number == NODE["attribute"]:
                for n, w, v in fields(self.buf, *value):
                    if w != 2:
                        continue
                    if n in (ATTRIBUTE["g"], ATTRIBUTE["graphs"]):
                        self.graph(v, depth + 1)
                    elif n in (ATTRIBUTE["t"], ATTRIBUTE["tensors"]):
                        self.tensor(v)
                    elif n in (ATTRIBUTE["sparse_tensor"], ATTRIBUTE["sparse_tensors"]):
                        self.sparse(v)
        self.domain(domain, f"node {op_type!r}")

    def domain(self, domain: str, where: str) -> None:
        if domain in self.domains_used:
            return
        self.domains_used.add(domain)
        if domain in STANDARD_DOMAINS or domain in self.local_domains:
            return
        if not _DOMAIN_RE.match(domain) or domain.startswith((".", "-")):
            self.sink.add(Severity.DANGEROUS, "onnx.domain.malformed",
                          f"{where} uses operator domain {domain[:80]!r}, which is not a domain name", name=domain)
        else:
            self.sink.add(Severity.SUSPICIOUS, "onnx.domain.custom",
                          f"{where} uses operator domain {domain!r}: it runs only with a custom-op library the "
                          "loader registers (native code outside the file)", name=domain)

    def sparse(self, span) -> None:
        for number, wire, value in fields(self.buf, *span):
            if wire == 2 and number in SPARSE.values():
                self.tensor(value)

    def tensor(self, span) -> None:
        self.tensors += 1
        name, entries = "", {}
        for number, wire, value in fields(self.buf, *span):
            if number == TENSOR["name"] and wire == 2:
                name = _text(self.buf, value)
            elif number == TENSOR["external_data"] and wire == 2:
                key = val = ""
                for n, w, v in fields(self.buf, *value):
                    if w == 2 and n == 1:
                        key = _text(self.buf, v)
                    elif w == 2 and n == 2:
                        val = _text(self.buf, v)
                entries[key] = val
        if entries:
            self.external += 1
            self.external_data(name, entries)

    def external_data(self, name: str, entries: dict[str, str]) -> None:
        location = entries.get("location", "")
        problem = _location_problem(location, self.ctx.directory)
        if problem:
            self.sink.add(Severity.DANGEROUS, "onnx.external_data.escape",
                          f"initializer {name!r} reads external data from {location!r}, which {problem}", name=name)
            return
        if self.ctx.directory is None:
            return
        target = Path(self.ctx.directory) / location
        try:
            size = target.stat().st_size
            offset = int(entries.get("offset", "0") or 0)
            length = int(entries["length"]) if entries.get("length") else size - offset
        except FileNotFoundError:
            self.sink.add(Severity.SUSPICIOUS, "onnx.external_data.missing",
                          f"initializer {name!r}: external data file {location!r} does not exist", name=name)
            return
        except (OSError, ValueError) as e:
            self.sink.add(Severity.SUSPICIOUS, "onnx.external_data.invalid",
                          f"initializer {name!r}: external data entry cannot be checked ({e})", name=name)
            return
        if offset < 0 or length < 0 or offset + length > size:
            self.sink.add(Severity.DANGEROUS, "onnx.external_data.bounds",
                          f"initializer {name!r} reads bytes {offset}..{offset + length} of {location!r}, "
                          f"which has {size}", name=name)


def _location_problem(location: str, directory: str | None) -> str | None:
    if not location:
        return "is empty"
    if "\x00" in location:
        return "contains a NUL byte"
    if os.path.isabs(location) or location.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", location):
        return "is an absolute path"
    if ".." in re.split(r"[\\/]", location):
        return "climbs out of the model's folder with '..'"
    if directory is not None:
        root = os.path.realpath(directory)
        target = os.path.realpath(os.path.join(root, location))
        if os.path.commonpath([root, target]) != root:
            return "resolves (through a symlink) outside the model's folder"
    return None


def scan_onnx(buf, start: int, end: int, ctx: Context, label: str) -> None:
    walk = _Walk(buf, ctx, label)
    try:
        walk.model(start, end)
    except (_WireError, RecursionError) as e:
        ctx.sink(label).add(Severity.SUSPICIOUS, "onnx.malformed", f"the protobuf cannot be walked ({e})")
        return
    ctx.examined.append(f"{label}: ONNX model, {walk.nodes} nodes, {walk.tensors} tensors "
                        f"({walk.external} with external data), domains {sorted(walk.domains_used) or ['']}")
