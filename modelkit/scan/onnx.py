"""ONNX: a bounded protobuf wire-format walk over ModelProto for external data paths and operator domains.

Only the fields that matter are followed (field numbers in modelkit.parse.onnx); tensor bytes
(`raw_data`) are length-delimited fields that are skipped, never read. External data must resolve
inside the model's folder: an absolute path, a '..' component or a symlink that leaves the folder
lets a model read (and a converter copy out) any file on the machine. Standard library only.
"""
from __future__ import annotations

import os
import re

from modelkit.errors import ParseError
from modelkit.parse.onnx import ATTRIBUTE, FUNCTION, GRAPH, MODEL, NODE, SPARSE, TENSOR, TRAINING
from modelkit.parse.paths import location_problem
from modelkit.parse.protobuf import fields
from modelkit.scan.model import Severity

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from modelkit.scan.containers import Context

STANDARD_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "ai.onnx.training", "ai.onnx.preview.training",
                              "com.microsoft", "com.microsoft.nchwc", "com.microsoft.experimental",
                              "com.ms.internal.nhwc", "org.pytorch.aten"})
MAX_DEPTH = 32
_DOMAIN_RE = re.compile(r"[A-Za-z0-9_.\-]{1,200}\Z")


class _TooDeep(ParseError):
    """Subgraphs nested deeper than MAX_DEPTH."""


def _text(buf, span) -> str:
    return bytes(buf[span[0]:span[1]]).decode("utf-8", "replace")   # names in findings: never fail on them


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
            raise _TooDeep(f"subgraphs nested deeper than {MAX_DEPTH}")
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
        problem = location_problem(location, self.ctx.directory)
        if problem:
            self.sink.add(Severity.DANGEROUS, "onnx.external_data.escape",
                          f"initializer {name!r} reads external data from {location!r}, which {problem}", name=name)
            return
        if self.ctx.directory is None:
            return
        target = os.path.join(self.ctx.directory, location)
        self.ctx.data_files.append(os.path.realpath(target))
        try:
            size = os.stat(target).st_size
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


def scan_onnx(buf, start: int, end: int, ctx: Context, label: str) -> None:
    walk = _Walk(buf, ctx, label)
    try:
        walk.model(start, end)
    except (ParseError, RecursionError) as e:
        ctx.sink(label).add(Severity.SUSPICIOUS, "onnx.malformed", f"the protobuf cannot be walked ({e.reason if isinstance(e, ParseError) else e})")
        return
    ctx.examined.append(f"{label}: ONNX model, {walk.nodes} nodes, {walk.tensors} tensors "
                        f"({walk.external} with external data), domains {sorted(walk.domains_used) or ['']}")
