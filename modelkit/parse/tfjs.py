"""TensorFlow.js `model.json`: a Layers model (a Keras config) or a graph model (a TF GraphDef in JSON),
and the manifest of the weight shards beside it.

    {"format": "layers-model" | "graph-model", "generatedBy", "convertedBy",
     "modelTopology": <Keras config, maybe wrapped as {"model_config": ...}> | {"node": [...], "library": ...},
     "weightsManifest": [{"paths": ["group1-shard1of2.bin", ...],
                          "weights": [{"name", "shape", "dtype", "quantization"?: {"dtype", ...}}]}]}

A group's shards are concatenated in order and its weights laid end to end in them, so the shards'
total size must equal the weights' byte sizes (shape x dtype size, or the quantized dtype's size).
Manifest paths are held to the ONNX external-data rules of `modelkit.parse.paths`. Sizes and counts
are capped before anything is built; nothing here reads a shard's bytes. Standard library only.
Spec: tfjs-core/src/io/types.ts (ModelJSON, WeightsManifestConfig) and tfjs-converter's GraphDef JSON.
"""
from __future__ import annotations

import os
import stat

from modelkit.errors import ParseError
from modelkit.parse.keras import load_json, model_config
from modelkit.parse.paths import location_problem, plain_file

FORMATS = ("layers-model", "graph-model")
MAX_GROUPS = 100_000
MAX_PATHS = 100_000          # all groups together
MAX_WEIGHTS = 1_000_000      # all groups together
MAX_NODES = 1_000_000        # graph nodes, functions' nodes included
MAX_RANK = 64
MAX_ELEMENTS = 1 << 62
# Manifest dtype -> bytes per element (tfjs-core DataType, and float16 as tensorflowjs_converter writes it);
# "string" weights hold length-prefixed bytes, so their size is known only from the data.
DTYPE_BYTES = {"float32": 4, "int32": 4, "bool": 1, "complex64": 8, "float16": 2, "string": None,
               "uint8": 1, "int8": 1, "uint16": 2, "int16": 2}
# quantization.dtype -> bytes per stored element (tfjs-core io/types.ts: uint8, uint16 with min/scale; float16)
QUANTIZED_BYTES = {"uint8": 1, "uint16": 2, "float16": 2}


class Weight:
    """One manifest entry: name, shape, dtype, quantization (a dict, or None), and its size in the shards.

    `nbytes` is None for string weights, whose size only the data tells.
    """

    __slots__ = ("name", "shape", "dtype", "quantization", "nbytes")

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str, quantization: dict | None,
                 nbytes: int | None) -> None:
        self.name, self.shape, self.dtype, self.quantization, self.nbytes = name, shape, dtype, quantization, nbytes

    def __repr__(self) -> str:
        return f"Weight({self.name!r}, shape={self.shape}, dtype={self.dtype!r}, nbytes={self.nbytes})"


class Group:
    """A manifest group: its shard paths, in order, and the weights laid end to end in them."""

    __slots__ = ("paths", "weights")

    def __init__(self, paths: tuple[str, ...], weights: tuple[Weight, ...]) -> None:
        self.paths, self.weights = paths, weights

    @property
    def nbytes(self) -> int | None:
        """The bytes the weights need; None when a string weight makes it unknowable."""
        sizes = [w.nbytes for w in self.weights]
        return None if None in sizes else sum(sizes)


class Model:
    """A parsed model.json.

    Args:
        format: "layers-model" or "graph-model" (declared, or told from the topology when absent).
        config: A Layers model's Keras config, the `model_config` wrapper removed; None for graph models.
        nodes: A graph model's nodes (dicts with "op", "name"...), the library's functions' nodes
            included; empty for Layers models.
        groups: The weights manifest.
        document: The whole JSON document.
    """

    __slots__ = ("format", "config", "nodes", "groups", "document")

    def __init__(self, format: str, config: dict | None, nodes: list[dict], groups: list[Group],  # noqa: A002
                 document: dict) -> None:
        self.format, self.config, self.nodes, self.groups, self.document = format, config, nodes, groups, document


def looks_like_model(doc) -> bool:
    """A decoded JSON document is a TF.js model.json: a declared TF.js format, or a topology with a manifest."""
    if not isinstance(doc, dict):
        return False
    if doc.get("format") in FORMATS:
        return True
    return "modelTopology" in doc and "weightsManifest" in doc


def read_model(buf, start: int = 0, end: int | None = None) -> Model:
    """Parse the model.json in buf[start:end] (at most keras.MAX_JSON bytes, checked before decoding).

    Raises:
        ParseError: too large, not JSON, or not a TF.js model of either format.
    """
    return from_document(load_json(buf, start, end))


def from_document(doc) -> Model:
    """The parts of a decoded model.json.

    Raises:
        ParseError: not a TF.js model, an unknown format, or a topology or manifest of the wrong shape.
    """
    if not isinstance(doc, dict) or "modelTopology" not in doc and "weightsManifest" not in doc:
        raise ParseError("not a TensorFlow.js model.json (no modelTopology or weightsManifest)")
    topology = doc.get("modelTopology")
    fmt = doc.get("format")
    if fmt is None:
        fmt = "graph-model" if isinstance(topology, dict) and "node" in topology else "layers-model"
    if fmt not in FORMATS:
        raise ParseError(f"format {str(fmt)[:40]!r} is not a TensorFlow.js model format ({', '.join(FORMATS)})")
    config, nodes = None, []
    if fmt == "layers-model" and topology is not None:
        config = model_config(topology)
        if config is None:
            raise ParseError("modelTopology of a layers-model is not a Keras model config "
                             "(no class_name, no model_config)")
    elif fmt == "graph-model" and topology is not None:
        nodes = graph_nodes(topology)
    return Model(fmt, config, nodes, manifest(doc.get("weightsManifest")), doc)


def graph_nodes(topology) -> list[dict]:
    """A GraphDef's nodes: `node`, then each `library.function[].nodeDef` (control flow lives there).

    Raises:
        ParseError: a node list or node that is not what a GraphDef holds, or more than MAX_NODES.
    """
    if not isinstance(topology, dict):
        raise ParseError("modelTopology of a graph-model is not a GraphDef object")
    lists = [("node", topology.get("node", []))]
    library = topology.get("library", {})
    functions = library.get("function", []) if isinstance(library, dict) else None
    if not isinstance(functions, list):
        raise ParseError("modelTopology.library.function is not a list")
    for i, function in enumerate(functions):
        if not isinstance(function, dict):
            raise ParseError(f"modelTopology.library.function[{i}] is not an object")
        lists.append((f"library.function[{i}].nodeDef", function.get("nodeDef", [])))
    nodes: list[dict] = []
    for where, items in lists:
        if not isinstance(items, list):
            raise ParseError(f"modelTopology.{where} is not a list")
        if len(nodes) + len(items) > MAX_NODES:
            raise ParseError(f"the graph has more than {MAX_NODES} nodes")
        for i, node in enumerate(items):
            if not isinstance(node, dict) or not isinstance(node.get("op"), str):
                raise ParseError(f"modelTopology.{where}[{i}] is not a node with an op")
            nodes.append(node)
    return nodes


def declared_paths(doc) -> list[tuple[int, str]]:
    """(group index, path) for every string in every group's `paths`, whatever else the manifest
    holds: the scanner checks these even when the rest of the manifest does not parse."""
    groups = doc.get("weightsManifest") if isinstance(doc, dict) else None
    found: list[tuple[int, str]] = []
    for g, group in enumerate(groups[:MAX_GROUPS] if isinstance(groups, list) else []):
        items = group.get("paths") if isinstance(group, dict) else None
        for path in items if isinstance(items, list) else []:
            if isinstance(path, str):
                found.append((g, path))
            if len(found) >= MAX_PATHS:
                return found
    return found


def manifest(groups) -> list[Group]:
    """The weights manifest (None for a model.json without one: a topology alone).

    Raises:
        ParseError: not a list of {"paths": [str], "weights": [...]} groups, a weight without a valid
            name, shape or dtype, or more than MAX_GROUPS / MAX_PATHS / MAX_WEIGHTS.
    """
    if groups is None:
        return []
    if not isinstance(groups, list):
        raise ParseError("weightsManifest is not a list of groups")
    if len(groups) > MAX_GROUPS:
        raise ParseError(f"weightsManifest has {len(groups)} groups, more than {MAX_GROUPS}")
    parsed, n_paths, n_weights = [], 0, 0
    for g, group in enumerate(groups):
        if not isinstance(group, dict):
            raise ParseError(f"weightsManifest[{g}] is not an object")
        paths, weights = group.get("paths"), group.get("weights")
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise ParseError(f"weightsManifest[{g}].paths is not a list of file names")
        if not isinstance(weights, list):
            raise ParseError(f"weightsManifest[{g}].weights is not a list")
        n_paths, n_weights = n_paths + len(paths), n_weights + len(weights)
        if n_paths > MAX_PATHS or n_weights > MAX_WEIGHTS:
            raise ParseError(f"weightsManifest names more than {MAX_PATHS} shards or {MAX_WEIGHTS} weights")
        parsed.append(Group(tuple(paths), tuple(_weight(w, f"weightsManifest[{g}].weights[{i}]")
                                                for i, w in enumerate(weights))))
    return parsed


def _weight(entry, where: str) -> Weight:
    if not isinstance(entry, dict):
        raise ParseError(f"{where} is not an object")
    name, shape, dtype = entry.get("name"), entry.get("shape"), entry.get("dtype")
    if not isinstance(name, str):
        raise ParseError(f"{where} has no name")
    if (not isinstance(shape, list) or len(shape) > MAX_RANK
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise ParseError(f"weight {name[:80]!r} has shape {str(shape)[:80]}; a shape is up to {MAX_RANK} "
                         "non-negative integers")
    if dtype not in DTYPE_BYTES:
        raise ParseError(f"weight {name[:80]!r} has dtype {str(dtype)[:40]!r}; known: {', '.join(DTYPE_BYTES)}")
    elements = 1
    for d in shape:
        elements *= d
        if elements > MAX_ELEMENTS:
            raise ParseError(f"weight {name[:80]!r} has shape {shape[:8]}, more than 2**62 elements")
    quantization = entry.get("quantization")
    size = DTYPE_BYTES[dtype]
    if quantization is not None:
        if not isinstance(quantization, dict) or quantization.get("dtype") not in QUANTIZED_BYTES:
            raise ParseError(f"weight {name[:80]!r} has quantization {str(quantization)[:80]}; known quantized "
                             f"dtypes: {', '.join(QUANTIZED_BYTES)}")
        size = QUANTIZED_BYTES[quantization["dtype"]]
    return Weight(name, tuple(shape), dtype, quantization, None if size is None else elements * size)


# ---------------------------------------------------------------------------------------------
# The shards on disk.

class ShardProblem:
    """Something wrong with a group's shards: kind is "escape", "missing" or "size"; message is one line."""

    __slots__ = ("kind", "group", "path", "message")

    def __init__(self, kind: str, group: int, path: str, message: str) -> None:
        self.kind, self.group, self.path, self.message = kind, group, path, message

    def __repr__(self) -> str:
        return f"ShardProblem({self.kind!r}, group={self.group}, path={self.path!r}, {self.message!r})"


def shard_problems(model: Model, directory: str) -> list[ShardProblem]:
    """Check each group's shards against the folder of the model.json: every path is a file name inside
    `directory` (parse.paths rules: no absolute path, no '..', no symlink out), an existing regular
    file, and the group's shards together hold exactly the bytes its weights need. Only sizes are
    looked at (os.stat); nothing outside the folder is touched and no shard is read.
    """
    return _shards(model, directory)[0]


def _shards(model: Model, directory: str) -> tuple[list[ShardProblem], list[list[str]]]:
    """(problems, each group's shard files as real paths). A plain file name of a regular file costs one
    lstat (parse.paths.plain_file); anything else goes through the full location rules."""
    problems: list[ShardProblem] = []
    root = os.path.realpath(directory)
    resolved: list[list[str]] = []
    for g, group in enumerate(model.groups):
        total, complete, files = 0, True, []
        for path in group.paths:
            target = plain_file(root, path)
            if target is None:
                problem = location_problem(path, directory)
                if problem is not None:
                    problems.append(ShardProblem("escape", g, path, f"weight shard {path[:200]!r} {problem}"))
                    complete = False
                    continue
                target = os.path.realpath(os.path.join(directory, path.replace("\\", "/")))
            try:
                info = os.stat(target)
            except OSError:
                info = None
            if info is None or not stat.S_ISREG(info.st_mode):
                problems.append(ShardProblem("missing", g, path, f"weight shard {path[:200]!r} "
                                             + ("does not exist" if info is None else "is not a regular file")))
                complete = False
                continue
            total += info.st_size
            files.append(target)
        resolved.append(files)
        declared = group.nbytes
        if complete and declared is not None and total != declared:
            how = (f"{declared - total} bytes short: a reader would run past the end"
                   if total < declared else f"{total - declared} bytes more than the weights need")
            problems.append(ShardProblem("size", g, ", ".join(group.paths)[:200],
                                         f"group {g + 1}'s shards hold {total} bytes, its weights need "
                                         f"{declared} ({how})"))
    return problems, resolved


def resolve_shards(model: Model, directory: str) -> list[list[str]]:
    """Each group's shard files (real paths), for a reader, after `shard_problems` finds nothing.

    Raises:
        ParseError: the first shard problem, as one line.
    """
    problems, resolved = _shards(model, directory)
    if problems:
        raise ParseError(problems[0].message)
    return resolved
