"""TensorFlow SavedModel (`saved_model.pb`): its meta graphs, graph nodes and function library, from the wire format.

Spec: tensorflow/core/protobuf/saved_model.proto, meta_graph.proto, saver.proto, saved_object_graph.proto and
tensorflow/core/framework/{graph,node_def,function,attr_value,op_def}.proto (TF 2.21). Field numbers:

    SavedModel     1 saved_model_schema_version | 2 meta_graphs (MetaGraphDef)
    MetaGraphDef   1 meta_info_def {4 tags, 5 tensorflow_version} | 2 graph_def | 3 saver_def |
                   5 signature_def map | 7 object_graph_def
    SaverDef       1 filename_tensor_name | 2 save_tensor_name | 3 restore_op_name
    GraphDef       1 node (NodeDef) | 2 library (FunctionDefLibrary)
    FunctionDefLibrary 1 function (FunctionDef)
    FunctionDef    1 signature (OpDef {1 name}) | 3 node_def (NodeDef)
    NodeDef        1 name | 2 op | 3 input | 5 attr map<string, AttrValue>
    AttrValue      1 list (ListValue {2 s, 9 func}) | 2 s | 10 func (NameAttrList {1 name, 2 attr map})
    SavedObjectGraph 1 nodes (SavedObject {4 user_object: SavedUserObject {1 identifier, 3 metadata}}) |
                   2 concrete_functions map
    SavedMetadata  (keras_metadata.pb, Keras 2) 1 nodes {1 node_id, 2 version, 3 node_path, 4 identifier,
                   5 metadata}

Keras 2 keeps each layer's config as JSON in a SavedUserObject's metadata (TF <= 2.4) or in keras_metadata.pb
(later): a Lambda layer's bytecode is there, so both are returned for the scanner's Keras analysis.

What a scanner needs is every node (top graph and every library function, never only what a
signature reaches), the functions each node calls (its `func` attributes, or an op that names a
library function) and its string attributes. Tensor constants are skipped, never decoded.
Standard library only.
"""
from __future__ import annotations

from modelkit.errors import ParseError
from modelkit.parse.protobuf import LEN, VARINT, fields, text, varint

SAVED_MODEL_FILE = "saved_model.pb"
VARIABLES_PREFIX = "variables/variables"
MAX_ATTR_DEPTH = 16
MAX_NODES = 5_000_000


# Plain slotted classes, not dataclasses: the scanner imports this module, and dataclasses' import is slow.
class Node:
    """One NodeDef: where it is ("graph" or a function's name), its name and op, its inputs, the function names
    in its attributes (`calls`) and its string attributes (`strings`: attribute -> values)."""

    __slots__ = ("where", "name", "op", "inputs", "calls", "strings")

    def __init__(self, where: str, name: str = "", op: str = "") -> None:
        self.where, self.name, self.op = where, name, op
        self.inputs: list[str] = []
        self.calls: list[str] = []
        self.strings: dict[str, list[str]] = {}


class MetaGraph:
    """One MetaGraphDef: tags, TensorFlow version, the top-level nodes, the library's functions by name, the
    saver's tensor names, signature keys, the object graph's size and its user objects' (identifier, metadata)."""

    __slots__ = ("tags", "tensorflow_version", "nodes", "functions", "saver", "signatures", "object_nodes",
                 "user_metadata")

    def __init__(self) -> None:
        self.tags: list[str] = []
        self.tensorflow_version = ""
        self.nodes: list[Node] = []
        self.functions: dict[str, list[Node]] = {}
        self.saver: dict[str, str] = {}
        self.signatures: list[str] = []
        self.object_nodes = 0
        self.user_metadata: list[tuple[str, str]] = []


class SavedModel:
    __slots__ = ("schema_version", "meta_graphs")

    def __init__(self) -> None:
        self.schema_version = 0
        self.meta_graphs: list[MetaGraph] = []


_SAVER = {1: "filename_tensor_name", 2: "save_tensor_name", 3: "restore_op_name"}


def _strings_and_funcs(buf, span, strings: list[str], funcs: list[str], depth: int) -> None:
    """The string values and function names of an AttrValue (lists and nested NameAttrLists too)."""
    if depth > MAX_ATTR_DEPTH:
        raise ParseError(f"attributes nested deeper than {MAX_ATTR_DEPTH}", offset=span[0])
    for number, wire, value in fields(buf, *span):
        if wire != LEN:
            continue
        if number == 2:
            strings.append(text(buf, value, strict=False))
        elif number == 1:                               # ListValue
            for n, w, v in fields(buf, *value):
                if n == 2 and w == LEN:
                    strings.append(text(buf, v, strict=False))
                elif n == 9 and w == LEN:
                    _name_attr_list(buf, v, strings, funcs, depth + 1)
        elif number == 10:
            _name_attr_list(buf, value, strings, funcs, depth + 1)


def _name_attr_list(buf, span, strings: list[str], funcs: list[str], depth: int) -> None:
    for number, wire, value in fields(buf, *span):
        if number == 1 and wire == LEN:
            funcs.append(text(buf, value, strict=False))
        elif number == 2 and wire == LEN:                 # map entry {1 key, 2 AttrValue}
            for n, w, v in fields(buf, *value):
                if n == 2 and w == LEN:
                    _strings_and_funcs(buf, v, strings, funcs, depth + 1)


def node(buf, span, where: str) -> Node:
    """A NodeDef."""
    out = Node(where)
    for number, wire, value in fields(buf, *span):
        if wire != LEN:
            continue
        if number == 1:
            out.name = text(buf, value, strict=False)
        elif number == 2:
            out.op = text(buf, value, strict=False)
        elif number == 3:
            out.inputs.append(text(buf, value, strict=False))
        elif number == 5:                                  # map entry {1 key, 2 AttrValue}
            key, strings = "", []
            for n, w, v in fields(buf, *value):
                if n == 1 and w == LEN:
                    key = text(buf, v, strict=False)
                elif n == 2 and w == LEN:
                    _strings_and_funcs(buf, v, strings, out.calls, 0)
            if strings:
                out.strings[key] = strings
    return out


def _function(buf, span) -> tuple[str, list[Node]]:
    name, spans = "", []
    for number, wire, value in fields(buf, *span):
        if number == 1 and wire == LEN:
            for n, w, v in fields(buf, *value):
                if n == 1 and w == LEN:
                    name = text(buf, v, strict=False)
        elif number == 3 and wire == LEN:
            spans.append(value)
    return name, [node(buf, s, name) for s in spans]


def graph_def(buf, span, meta: MetaGraph) -> None:
    """A GraphDef's nodes and function library into `meta`."""
    for number, wire, value in fields(buf, *span):
        if wire != LEN:
            continue
        if number == 1:
            meta.nodes.append(node(buf, value, "graph"))
        elif number == 2:
            for n, w, v in fields(buf, *value):
                if n == 1 and w == LEN:
                    name, nodes = _function(buf, v)
                    if name in meta.functions:
                        raise ParseError(f"function {name!r} is defined twice in the library", offset=v[0])
                    meta.functions[name] = nodes
        if len(meta.nodes) > MAX_NODES:
            raise ParseError(f"more than {MAX_NODES} graph nodes")


def _meta_graph(buf, span) -> MetaGraph:
    meta = MetaGraph()
    for number, wire, value in fields(buf, *span):
        if wire != LEN:
            continue
        if number == 1:
            for n, w, v in fields(buf, *value):
                if n == 4 and w == LEN:
                    meta.tags.append(text(buf, v, strict=False))
                elif n == 5 and w == LEN:
                    meta.tensorflow_version = text(buf, v, strict=False)
        elif number == 2:
            graph_def(buf, value, meta)
        elif number == 3:
            meta.saver = {_SAVER[n]: text(buf, v, strict=False) for n, w, v in fields(buf, *value)
                          if n in _SAVER and w == LEN}
        elif number == 5:
            for n, w, v in fields(buf, *value):
                if n == 1 and w == LEN:
                    meta.signatures.append(text(buf, v, strict=False))
        elif number == 7:
            for n, w, v in fields(buf, *value):
                if n == 1 and w == LEN:
                    meta.object_nodes += 1
                    meta.user_metadata.extend(_user_object(buf, v))
    return meta


def _user_object(buf, span) -> list[tuple[str, str]]:
    """A SavedObject's user_object (identifier, metadata), when it has metadata."""
    found = []
    for number, wire, value in fields(buf, *span):
        if number == 4 and wire == LEN:
            parts = {n: text(buf, v, strict=False) for n, w, v in fields(buf, *value) if w == LEN and n in (1, 3)}
            if parts.get(3):
                found.append((parts.get(1, ""), parts[3]))
    return found


def keras_metadata(buf, start: int = 0, end: int | None = None) -> list[tuple[str, str]]:
    """keras_metadata.pb's (node path, metadata JSON) for every node.

    Raises:
        ParseError: not a SavedMetadata's wire format.
    """
    end = len(buf) if end is None else end
    found = []
    for number, wire, value in fields(buf, start, end):
        if number != 1 or wire != LEN:
            raise ParseError(f"field {number} is not a SavedMetadata field", offset=start)
        parts = {n: text(buf, v, strict=False) for n, w, v in fields(buf, *value) if w == LEN and n in (3, 5)}
        found.append((parts.get(3, ""), parts.get(5, "")))
    return found


def read(buf, start: int = 0, end: int | None = None) -> SavedModel:
    """The SavedModel in buf[start:end].

    Raises:
        ParseError: the bytes are not a SavedModel's wire format.
    """
    end = len(buf) if end is None else end
    model = SavedModel()
    for number, wire, value in fields(buf, start, end):
        if number == 1 and wire == VARINT:
            model.schema_version = value
        elif number == 2 and wire == LEN:
            model.meta_graphs.append(_meta_graph(buf, value))
        elif number not in (1, 2):
            raise ParseError(f"field {number} is not a SavedModel field", offset=start)
    if not model.meta_graphs:
        raise ParseError("a SavedModel with no meta graph")
    return model


def looks_like(buf, start: int, end: int) -> bool:
    """A SavedModel by its first bytes: schema version 1 (08 01), then a meta graph (12 len) whose first
    field is a MetaInfoDef (0a) or a GraphDef (12)."""
    if end - start < 6 or bytes(buf[start:start + 3]) != b"\x08\x01\x12":
        return False
    try:
        _, pos = varint(buf, start + 3, end)
    except ParseError:
        return False
    return pos < end and buf[pos] in (0x0A, 0x12)


def fingerprint(buf, start: int, end: int) -> bool:
    """A SavedModel's fingerprint.pb (FingerprintDef, fingerprint.proto): fields 1-5 varints (hashes), 6 a
    small VersionDef, 7 the UUID as a short string of digits; nothing else (an ONNX graph is no UUID)."""
    if end - start > 1024:
        return False
    try:
        seen = list(fields(buf, start, end))
        for number, wire, value in seen:
            if wire == VARINT and 1 <= number <= 5:
                continue
            if wire == LEN and number == 6 and value[1] - value[0] <= 64:
                continue
            if wire == LEN and number == 7 and value[1] - value[0] <= 64 and bytes(
                    buf[value[0]:value[1]]).replace(b"-", b"").isalnum():
                continue
            return False
    except ParseError:
        return False
    return bool(seen)
