"""PT2 archives (torch.export.save): what torch.export.load would unpickle, link or call.

torch.export.load (torch/export/pt2_archive/_package.py, torch/_export/serde/serialize.py) reads the program
JSON and raw tensor bytes, and also:
- unpickles: entries of the weights/constants configs with `use_pickle` (torch.load, weights_only=False),
  `opaque_obj_*` constants (pickle.loads), `custom_obj_*` constants (TorchScript's pickler, a torchbind
  class), the sample inputs (torch.load, retried with weights_only=False when the safe load fails);
- resolves every graph node's `target` string by attribute lookup from `torch`, `operator` or `math`
  (`deserialize_operator`), then calls it when the module runs: "torch.ops.aten.linear.default" is an
  operator; "torch.load" or "torch.os.system" would be called just the same;
- runs AOTInductor packages (data/aotinductor/: compiled shared libraries it loads with dlopen).

So: pickles are walked like every pickle (containers scans them as members); raw tensor members named by
the configs are skipped unread; a config naming a member outside its folder, a target outside torch's
operator namespaces and the plain operators, and any compiled library are DANGEROUS; custom operator
namespaces, torchbind objects and opaque pickled objects need trust. Standard library only.
"""
from __future__ import annotations

import json
import re

from modelkit.scan.model import Severity
from modelkit.scan.torchscript import KNOWN_OP_NAMESPACES

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

    from modelkit.scan.containers import Context

MAX_JSON = 256 << 20
_OP_TARGET = re.compile(r"torch\.ops\.(\w+)\.(\w+)(?:\.(\w+))?")
_FILE_OPS = re.compile(r"(save|load|_load\w*|from_file|_jit\w*)")
# torch.export's own namespaces beyond TorchScript's
_NAMESPACES = KNOWN_OP_NAMESPACES | {"higher_order", "prims", "_higher_order_ops", "_quantized_decomposed",
                                     "torchao", "_inductor_test", "_c10d_functional_autograd"}
# Python-level targets torch.export writes: symbolic-shape arithmetic (operator, math) and torch.sym_* helpers.
_OPERATOR = frozenset({"getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs",
                       "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert", "lshift",
                       "rshift", "matmul", "index", "truth"})
_MATH = frozenset({"ceil", "floor", "trunc", "sqrt", "exp", "log", "log2", "log10", "sin", "cos", "tan", "tanh",
                   "fabs", "pow", "isnan", "isinf", "isfinite", "gcd", "lcm", "floordiv"})
_TORCH = frozenset({"sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_ite", "sym_sqrt", "sym_sum",
                    "sym_fresh_size", "_assert", "_assert_async", "_assert_scalar", "_sym_sqrt", "_check",
                    "_check_is_size", "sym_and", "sym_or"})
TEXT_RECORDS = frozenset({"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"})


class Layout:
    """What the configs of one archive say about its members, filled as they are scanned (configs first).

    `raw` members hold tensor bytes torch reads as they are (skipped unread); `expected` are members torch
    unpickles or reads as nested archives (their nesting is no finding of its own)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.raw: set[str] = set()
        self.expected: set[str] = set()

    def is_raw(self, name: str) -> bool:
        """Read as raw bytes by every entry that names it (one entry that unpickles it makes it a pickle)."""
        return name in self.raw and name not in self.expected

    def nested_ok(self, name: str) -> bool:
        return name in self.expected or name.startswith(f"{self.root}/data/sample_inputs/")


def sort_key(name: str, root: str) -> int:
    """Configs and programs first (they say which members are raw bytes), then pickles, then the rest."""
    rest = name[len(root) + 1:] if name.startswith(f"{root}/") else name
    if rest.startswith(("data/weights/", "data/constants/")) and rest.endswith("_config.json"):
        return 0
    return 1 if rest.startswith("models/") else 2


def scan_member(content: bytes, name: str, member: str, ctx: Context, layout: Layout) -> str | None:
    """Judge one member that only a PT2 archive has; returns the member's kind for the counts, or None when
    it is not one (containers then scans it by content)."""
    root = layout.root
    rest = name[len(root) + 1:] if name.startswith(f"{root}/") else name
    sink = ctx.sink(member)
    if rest.startswith("data/aotinductor/"):
        sink.add(Severity.DANGEROUS, "pt2.aotinductor",
                 f"{rest!r} is part of an AOTInductor package: torch.export/aoti loaders compile or dlopen it, "
                 "running native code from the file", name=name)
        return "code"
    if rest in TEXT_RECORDS and len(content) <= 80:
        return "other"
    if rest.startswith(("data/weights/", "data/constants/")) and rest.endswith("_config.json"):
        _scan_config(content, rest.rsplit("/", 1)[0] + "/", sink, layout)
        return "other"
    if rest.startswith("models/") and rest.endswith(".json"):
        _scan_program(content, sink)
        ctx.examined.append(f"{member}: exported program")
        return "other"
    return None


def _load(content: bytes, sink: Any, what: str) -> Any:
    if len(content) > MAX_JSON:
        sink.add(Severity.DANGEROUS, "scan.limit.bytes", f"{what} is larger than {MAX_JSON} bytes")
        return None
    try:
        return json.loads(content)
    except (ValueError, RecursionError) as e:
        sink.add(Severity.DANGEROUS, "pt2.json.malformed", f"{what} is not valid JSON ({str(e)[:80]}); torch's "
                 "reader and this scanner may disagree about it")
        return None


def _scan_config(content: bytes, folder: str, sink: Any, layout: Layout) -> None:
    value = _load(content, sink, "a payload config")
    config = value.get("config") if isinstance(value, dict) else None
    if not isinstance(config, dict):
        if value is not None:
            sink.add(Severity.DANGEROUS, "pt2.json.malformed", "a payload config without a 'config' object")
        return
    for fqn, meta in config.items():
        path = meta.get("path_name") if isinstance(meta, dict) else None
        if not isinstance(path, str) or not path or "/" in path or "\\" in path or path in (".", "..") or "\x00" in path:
            sink.add(Severity.DANGEROUS, "pt2.config.path",
                     f"entry {str(fqn)[:80]!r} names {str(path)[:80]!r}, not a file of {folder}: torch joins it to "
                     "the folder as given", name=str(fqn)[:200])
            continue
        member = f"{layout.root}/{folder}{path}"
        if meta.get("use_pickle") or not path.startswith(("weight_", "tensor_")):
            layout.expected.add(member)
            if path.startswith("opaque_obj_"):
                sink.add(Severity.SUSPICIOUS, "pt2.opaque_object",
                         f"constant {str(fqn)[:80]!r} is a Python object torch.export.load rebuilds with pickle.loads",
                         name=path)
            elif path.startswith("custom_obj_"):
                sink.add(Severity.SUSPICIOUS, "pt2.custom_object",
                         f"constant {str(fqn)[:80]!r} is a TorchScript custom-class object; loading it needs the "
                         "class's library and runs its __setstate__", name=path)
        else:
            layout.raw.add(member)


def _scan_program(content: bytes, sink: Any) -> None:
    value = _load(content, sink, "the exported program")
    if value is None:
        return
    graph = value.get("graph_module", {}).get("graph") if isinstance(value, dict) else None
    nodes = graph.get("nodes") if isinstance(graph, dict) else None
    if not isinstance(nodes, list):
        sink.add(Severity.DANGEROUS, "pt2.json.malformed", "the exported program has no graph_module.graph.nodes list")
        return
    for target in _targets(value):
        _judge_target(target, sink)
    custom = graph.get("custom_obj_values")
    if isinstance(custom, dict):
        for name, obj in list(custom.items())[:100]:
            fqn = obj.get("class_fqn") if isinstance(obj, dict) else None
            sink.add(Severity.SUSPICIOUS, "pt2.custom_object",
                     f"the graph takes {str(name)[:60]!r}, an object of the TorchScript class {str(fqn)[:80]!r}: "
                     "its library must be loaded, and its methods run", name=str(fqn)[:200])


def _targets(program: Any) -> list[str]:
    """Every node target of the program, its nested graphs too (control flow passes its branches as
    `as_graph` arguments, each with nodes of its own), each target once."""
    found: dict[str, None] = {}
    todo = [program]
    while todo:
        value = todo.pop()
        if isinstance(value, dict):
            nodes = value.get("nodes")
            if isinstance(nodes, list):
                for node in nodes:
                    target = node.get("target") if isinstance(node, dict) else None
                    if isinstance(target, str):
                        found.setdefault(target)
            todo.extend(value.values())
        elif isinstance(value, list):
            todo.extend(value)
    return list(found)


def _judge_target(target: str, sink: Any) -> None:
    """A node target as torch's deserializer resolves it (getattr from torch, operator or math)."""
    op = _OP_TARGET.fullmatch(target)
    if op is not None:
        namespace, name = op.group(1), op.group(2)
        if namespace == "aten" and _FILE_OPS.fullmatch(name):
            sink.add(Severity.DANGEROUS, "pt2.target.dangerous",
                     f"the graph calls {target}, an operator that reads or writes files", name=target)
        elif namespace not in _NAMESPACES:
            sink.add(Severity.SUSPICIOUS, "pt2.custom_op",
                     f"the graph calls torch.ops.{namespace}, operators from a library the loading process must "
                     "provide", name=namespace)
        return
    module, _, rest = target.partition(".")
    if target.startswith("#"):
        sink.add(Severity.SUSPICIOUS, "pt2.custom_op", f"the graph calls {target[:80]!r}, an extension operator "
                 "resolved by a handler the loading process registers", name=target[:200])
        return
    known = ((module == "_operator" and rest in _OPERATOR) or (module == "math" and rest in _MATH)
             or (module == "torch" and rest in _TORCH))
    if known:
        return
    if module in ("_operator", "math", "torch"):
        sink.add(Severity.DANGEROUS, "pt2.target.dangerous",
                 f"the graph calls {target[:120]!r}, which torch.export.load resolves by attribute lookup from "
                 f"{module} and calls when the program runs: not an operator", name=target[:200])
    else:
        sink.add(Severity.SUSPICIOUS, "pt2.target.unknown",
                 f"the graph names {target[:120]!r}, which torch does not resolve to a callable", name=target[:200])
