"""TensorFlow graphs (SavedModel `saved_model.pb`) and tensor bundles (checkpoint `.index` files).

A SavedModel's graph runs when it is loaded and called: an op that reads, lists or writes files at a
path the graph computes, calls the loading process's Python, or talks to the network reaches outside
the model. Every node is judged, in the top-level graph and in every function of the library (not only
those a signature reaches: the object graph can call any of them), by its op against `RISKY_OPS`.

The checkpoint ops (SaveV2, RestoreV2, MergeV2Checkpoints) are in every SavedModel TensorFlow writes:
the saver's own functions (the ones `saver_def` names through its save and restore nodes) use them to
read and write the variables/ folder. There they are expected; anywhere else (a function a signature or
the object graph can call) they write or read checkpoints at paths the graph computes, and are flagged.

A bundle's `.index` is a sorted table of entries (modelkit.parse.tf_bundle); the scanner checks it parses
and that every entry's bytes lie inside its shard (sizes only: tensor data is never read), and names the
shards as the index's tensor data. Standard library only.
"""
from __future__ import annotations

import os

from modelkit.errors import ParseError
from modelkit.parse import savedmodel, tf_bundle
from modelkit.scan.model import Severity
from modelkit.scan.tf_ops import ATTR_CHECKS, CHECKPOINT_OPS, DEBUG_OPS, RISKY_OPS, known_ops

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from modelkit.scan.containers import Context

D, S = Severity.DANGEROUS, Severity.SUSPICIOUS
MAX_FINDINGS = 100
KERAS_METADATA = "keras_metadata.pb"
MAX_KERAS_METADATA = 256 << 20


def _node_name(tensor: str) -> str:
    """The node a tensor or input names: "^x" and "x:0" are node "x"."""
    return tensor.lstrip("^").split(":", 1)[0]


def _saver_only(meta: savedmodel.MetaGraph) -> tuple[set[str], set[str]]:
    """(top-level node names, functions) that only the saver reaches."""
    by_name = {n.name: n for n in meta.nodes}
    roots = [_node_name(meta.saver.get(k, "")) for k in ("save_tensor_name", "restore_op_name")]
    saver_nodes: set[str] = set()
    queue = [r for r in roots if r in by_name]
    while queue:                                     # the top-level nodes the saver's outputs depend on
        name = queue.pop()
        if name in saver_nodes:
            continue
        saver_nodes.add(name)
        queue.extend(_node_name(i) for i in by_name[name].inputs if _node_name(i) in by_name)
    # The saver's own outputs also need the filename placeholder, which other nodes may read too; what
    # matters below is only which functions the saver alone calls.
    def closure(start: list[str]) -> set[str]:
        seen: set[str] = set()
        stack = [f for f in start if f in meta.functions]
        while stack:
            f = stack.pop()
            if f in seen:
                continue
            seen.add(f)
            for n in meta.functions[f]:
                stack.extend(c for c in (*n.calls, n.op) if c in meta.functions)
        return seen

    saver_calls = [c for n in meta.nodes if n.name in saver_nodes for c in (*n.calls, n.op)]
    reached_by_saver = closure(saver_calls)
    other_roots = [c for n in meta.nodes if n.name not in saver_nodes for c in (*n.calls, n.op)]
    other_roots += [f for f in meta.functions if f not in reached_by_saver]
    return saver_nodes, reached_by_saver - closure(other_roots)


def judge_nodes(nodes, ctx: Context, label: str, *, expected_checkpoint_io=lambda node: False,
                functions=frozenset()) -> int:
    """Findings for the nodes' ops (`functions`: the library's, which nodes may call as ops); returns how many
    were flagged."""
    sink = ctx.sink(label)
    flagged = 0

    def flag(severity: Severity, node, why: str) -> None:
        nonlocal flagged
        flagged += 1
        if flagged <= MAX_FINDINGS:
            where = "the top-level graph" if node.where == "graph" else f"function {node.where[:80]!r}"
            sink.add(severity, "tensorflow.graph.op",
                     f"node {node.name[:80]!r} in {where} is a {node.op} op, which {why}", name=node.op[:80])

    for node in nodes:
        risky = RISKY_OPS.get(node.op)
        if risky is not None:
            flag(risky[0], node, risky[1])
        elif node.op in CHECKPOINT_OPS and not expected_checkpoint_io(node):
            flag(D, node, f"{CHECKPOINT_OPS[node.op]} (outside the saver's own functions)")
        elif node.op in ATTR_CHECKS:
            attr, harmless = ATTR_CHECKS[node.op]
            values = [v for v in node.strings.get(attr, []) if v and v not in harmless]
            if values:
                flag(D, node, f"sends its output to {values[0][:120]!r} ({attr})")
        elif node.op in DEBUG_OPS:
            urls = [v for v in node.strings.get("debug_urls", []) if v]
            if urls:
                flag(D, node, f"sends tensors to {urls[0][:120]!r} (debug_urls)")
        elif node.op not in known_ops() and node.op not in functions:
            flagged += 1
            if flagged <= MAX_FINDINGS:
                sink.add(S, "tensorflow.graph.custom_op", f"node {node.name[:80]!r} is a {node.op[:80]!r} op, which "
                         "TensorFlow does not register: a custom op, native code from a library the loading "
                         "process must load (tf.load_op_library)", name=node.op[:80])
    return flagged


def scan_savedmodel(buf, start: int, end: int, ctx: Context, label: str) -> str:
    """Judge a saved_model.pb: every graph node and library function; and its variables/ bundle if on disk."""
    sink = ctx.sink(label, start)
    try:
        model = savedmodel.read(buf, start, end)
    except ParseError as e:
        sink.add(D, "tensorflow.savedmodel.malformed",
                 f"saved_model.pb cannot be parsed ({e.reason}); TensorFlow may read it differently than the scanner")
        ctx.examined.append(f"{label}: SavedModel, malformed")
        return "savedmodel"
    nodes = functions = flagged = configs = 0
    for meta in model.meta_graphs:
        configs += judge_keras(meta.user_metadata, ctx, label)
        saver_nodes, saver_functions = _saver_only(meta)

        def expected(node, saver_nodes=saver_nodes, saver_functions=saver_functions) -> bool:
            return node.where in saver_functions or (node.where == "graph" and node.name in saver_nodes)

        everything = [*meta.nodes, *(n for fn in meta.functions.values() for n in fn)]
        flagged += judge_nodes(everything, ctx, label, expected_checkpoint_io=expected, functions=meta.functions)
        nodes += len(everything)
        functions += len(meta.functions)
    bundle = keras = ""
    if ctx.depth == 0 and ctx.directory is not None:
        prefix = os.path.join(ctx.directory, *savedmodel.VARIABLES_PREFIX.split("/"))
        if os.path.isfile(prefix + ".index"):
            bundle = ", " + check_bundle(prefix, ctx, label)
        beside = os.path.join(ctx.directory, KERAS_METADATA)
        if os.path.isfile(beside) and os.path.getsize(beside) <= MAX_KERAS_METADATA:   # what tf_keras loads with it
            with open(beside, "rb") as f:
                keras = ", " + scan_keras_metadata(f.read(), 0, os.path.getsize(beside), ctx, f"{label}:{KERAS_METADATA}",
                                                   note=False)
    keras += f", {configs} Keras configs" if configs else ""
    return_note = (f"SavedModel, {len(model.meta_graphs)} meta graph(s), {nodes} nodes in the graph and "
                   f"{functions} functions, {flagged} risky op(s){bundle}{keras}")
    ctx.examined.append(f"{label}: {return_note}")
    return "savedmodel"


def judge_keras(metadata, ctx: Context, label: str) -> int:
    """Keras 2 layer configs (JSON) kept in a SavedModel: Lambda bytecode, named modules (scan.keras's rules)."""
    from modelkit.parse import keras as keras_json
    from modelkit.scan import keras

    count, first = 0, len(ctx.findings)
    for _, doc in metadata:
        try:
            config = keras_json.load_json(doc.encode())
        except ParseError:
            continue            # not every object's metadata is a Keras config; the raw text is searched below
        count += 1
        keras.analyse_config(config, ctx, label)
    # A model's config holds its layers' configs too: each layer is seen once per object that holds it.
    unique = {(f.rule, f.detail, f.path): f for f in ctx.findings[first:]}
    ctx.findings[first:] = list(unique.values())
    raw = "".join(doc for _, doc in metadata)
    if count == 0 and ('"class_name": "Lambda"' in raw or '"class_name":"Lambda"' in raw):
        ctx.sink(label).add(D, "keras.lambda", "object metadata names a Lambda layer, which carries Python bytecode",
                            name="Lambda")
    return count


def scan_keras_metadata(buf, start: int, end: int, ctx: Context, label: str, *, note: bool = True) -> str:
    """keras_metadata.pb (Keras 2 SavedModels): every node's config, judged as Keras configs are."""
    try:
        metadata = savedmodel.keras_metadata(buf, start, end)
    except ParseError as e:
        ctx.sink(label, start).add(D, "tensorflow.keras_metadata.malformed",
                                   f"keras_metadata.pb cannot be parsed ({e.reason}); Keras may read it differently")
        return "keras_metadata.pb malformed"
    count = judge_keras(metadata, ctx, label)
    phrase = f"Keras metadata, {len(metadata)} nodes, {count} configs checked"
    if note:
        ctx.examined.append(f"{label}: {phrase}")
    return phrase


def check_bundle(prefix: str, ctx: Context, label: str, buf=None) -> str:
    """Parse PREFIX.index (or `buf`, its bytes), check each entry lies inside its shard, and name the shards as
    tensor data of this scan. Returns a phrase for `examined`."""
    sink = ctx.sink(label)
    try:
        if buf is None:
            with open(prefix + ".index", "rb") as f:
                buf = f.read(tf_bundle.MAX_INDEX_BYTES + 1)
        bundle = tf_bundle.read_index(buf)
    except ParseError as e:
        sink.add(D, "tensorflow.index.malformed", f"the checkpoint index cannot be parsed ({e.reason})")
        return "checkpoint index malformed"
    except OSError as e:
        sink.add(S, "tensorflow.index.unreadable", f"{prefix}.index cannot be read ({e.strerror or e})")
        return "checkpoint index unreadable"
    sizes: dict[int, int | None] = {}
    for shard in range(min(bundle.num_shards, 10_000)):
        name = tf_bundle.shard_name(prefix, shard, bundle.num_shards)
        try:
            sizes[shard] = os.stat(name).st_size
            ctx.data_files.append(os.path.realpath(name))
        except OSError:
            sizes[shard] = None
    problems = 0
    for entry in bundle.entries.values():
        if entry.sliced or entry.size == 0:
            continue
        size = sizes.get(entry.shard)
        if size is None:
            problems += 1
            if problems <= MAX_FINDINGS:
                sink.add(S, "tensorflow.shard.missing", f"tensor {entry.key[:120]!r} is in shard {entry.shard}, "
                         f"whose file {os.path.basename(tf_bundle.shard_name(prefix, entry.shard, bundle.num_shards))} "
                         "is missing", name=entry.key[:120])
        elif entry.offset + entry.size > size:
            problems += 1
            if problems <= MAX_FINDINGS:
                sink.add(S, "tensorflow.shard.size", f"tensor {entry.key[:120]!r} claims bytes {entry.offset}.."
                         f"{entry.offset + entry.size} of a shard of {size} bytes", name=entry.key[:120])
    return f"checkpoint index of {len(bundle.entries)} entries in {bundle.num_shards} shard(s), sizes checked"


def scan_index(buf, start: int, end: int, ctx: Context, label: str) -> str:
    """A checkpoint's PREFIX.index: the table, and its shards beside it when on disk."""
    on_disk = ctx.depth == 0 and ctx.directory is not None and label.endswith(".index")
    if on_disk:
        prefix = os.path.join(ctx.directory, os.path.basename(label)[:-len(".index")])
        note = check_bundle(prefix, ctx, label, bytes(buf[start:end]))
    else:
        try:
            bundle = tf_bundle.read_index(bytes(buf[start:end]))
            note = f"checkpoint index of {len(bundle.entries)} entries (shards not checked: not on disk)"
        except ParseError as e:
            ctx.sink(label, start).add(D, "tensorflow.index.malformed",
                                       f"the checkpoint index cannot be parsed ({e.reason})")
            note = "checkpoint index malformed"
    ctx.examined.append(f"{label}: TensorFlow {note}")
    return "tf-checkpoint"


def scan_keras_metadata_file(buf, start: int, end: int, ctx: Context, label: str) -> str:
    scan_keras_metadata(buf, start, end, ctx, label)
    return "keras metadata"


def scan_fingerprint(buf, start: int, end: int, ctx: Context, label: str) -> str:
    ctx.examined.append(f"{label}: SavedModel fingerprint (hashes only)")
    return "savedmodel fingerprint"
