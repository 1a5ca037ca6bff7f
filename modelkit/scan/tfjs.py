"""TensorFlow.js model.json files: graph ops that reach outside the model, and the weight shards.

The Keras config of a Layers model (and anything else in the document that carries code) is judged
by scan.keras.analyse_config before this runs; here: a graph model's ops, manifest paths held to the
ONNX external-data rules (parse.paths), and each group's shards against the bytes its weights need,
from their sizes only (a shard is never read). Standard library only; imported only for JSON files.
"""
from __future__ import annotations

import os

from modelkit.errors import ParseError
from modelkit.parse import tfjs
from modelkit.parse.paths import location_problem, plain_file
from modelkit.scan import tf_ops
from modelkit.scan.model import Severity

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

    from modelkit.scan.containers import Context

# Ops a graph may hold that reach outside the model when a TensorFlow runtime runs it (a graph model
# converted back with tfjs-to-tf, or read by TF tooling; TF.js itself has no kernel for them and refuses
# to run them): TensorFlow's table (modelkit.scan.tf_ops), checkpoint I/O included (a TF.js graph
# has no saver). Op -> (severity, what it does).
RISKY_OPS = {**tf_ops.RISKY_OPS, **{op: (Severity.DANGEROUS, why) for op, why in tf_ops.CHECKPOINT_OPS.items()}}
_MAX_OP_FINDINGS = 100


def scan_model(doc: Any, ctx: Context, label: str) -> str:
    """Judge a decoded TF.js model.json; returns a phrase for `examined`."""
    sink = ctx.sink(label)
    on_disk = ctx.depth == 0 and ctx.directory is not None
    root = os.path.realpath(ctx.directory) if on_disk and ctx.directory is not None else None
    places: dict[str, tuple[str | None, str | None]] = {}

    def place(path: str) -> tuple[str | None, str | None]:
        """(the shard's real path on disk or None, why it may not be read or None). A plain name of a regular
        file in the folder costs one lstat (parse.paths.plain_file); anything else goes through the full rules."""
        if path not in places:
            plain = plain_file(root, path) if root is not None else None
            problem = None if plain is not None else location_problem(path, root)
            real = plain or (os.path.realpath(os.path.join(root, path.replace("\\", "/")))
                             if root is not None and problem is None else None)
            places[path] = (real, problem)
        return places[path]
    # Manifest paths first, from the raw document: an escape counts even when the rest does not parse.
    for group, path in tfjs.declared_paths(doc):
        problem = place(path)[1]
        if problem is not None:
            sink.add(Severity.DANGEROUS, "tfjs.path.escape",
                     f"weightsManifest[{group}] names shard {path[:200]!r}, which {problem}", name=path[:200])
    try:
        model = tfjs.from_document(doc)
    except ParseError as e:
        sink.add(Severity.SUSPICIOUS, "tfjs.malformed", f"the model.json cannot be read as TF.js reads it: {e.reason}")
        return "TF.js model.json, malformed"
    flagged = 0
    for node in model.nodes:
        severity, why = RISKY_OPS.get(node["op"], (None, None))
        if why is not None and flagged < _MAX_OP_FINDINGS:
            flagged += 1
            sink.add(severity, "tfjs.graph.op", f"graph node {str(node.get('name'))[:80]!r} is a "
                     f"{node['op']} op, which {why}", name=node["op"])
    shards = sum(len(g.paths) for g in model.groups)
    weights = sum(len(g.weights) for g in model.groups)
    if on_disk:
        for problem in tfjs.shard_problems(model, ctx.directory):
            if problem.kind == "missing":
                sink.add(Severity.SUSPICIOUS, "tfjs.shard.missing", problem.message, name=problem.path)
            elif problem.kind == "size":
                sink.add(Severity.SUSPICIOUS, "tfjs.shard.size", problem.message, name=problem.path)
            # "escape" was reported above, from the document
        ctx.data_files.extend(real for group in model.groups for path in group.paths
                              if (real := place(path)[0]) is not None)
    nodes = f", {len(model.nodes)} graph nodes" if model.format == "graph-model" else ""
    checked = "shard sizes checked" if on_disk else "shards not checked (not on disk)"
    return f"TF.js {model.format}{nodes}, {weights} weights in {shards} shards, {checked}"
