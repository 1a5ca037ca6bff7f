"""PT2 archives (torch.export.save), read without torch and without unpickling: the program's signature
and every weight and constant as a checked tensor record.

Layout (torch/export/pt2_archive/_package.py and torch/csrc/export/pt2_archive_constants.h, torch 2.13;
archive version 0). Every member sits under one folder `<root>/`:
    archive_format                       the text "pt2"
    archive_version                      "0"
    byteorder, .data/version, .data/serialization_id    small text records
    models/<model>.json                  the serialized ExportedProgram (torch/_export/serde/schema.py): graph
                                         nodes with string targets ("torch.ops.aten.linear.default"), the
                                         signature (which inputs are parameters, buffers, constants, user inputs),
                                         `tensor_values` (dtype code, sizes as ints or symbols, strides),
                                         `range_constraints` (each symbol's bounds), `schema_version`, `torch_version`
    data/weights/<model>_weights_config.json     {"config": {fqn: {"path_name", "is_param", "use_pickle",
                                                  "tensor_meta": {"dtype", "sizes", "strides", "storage_offset"}}}}
    data/weights/weight_<n>              a storage's raw little-endian bytes (several fqns may share one)
    data/constants/<model>_constants_config.json    the same for constants (lifted tensors, non-persistent buffers)
    data/constants/tensor_<n>            raw bytes; `custom_obj_<n>` (a torchbind object, TorchScript's pickler),
                                         `opaque_obj_<n>` (a Python pickle): what torch.export.load unpickles
    data/sample_inputs/<model>.pt        torch.save of the example (args, kwargs): a nested zip with a pickle
    extra/<name>                         `extra_files` of torch.export.save (modelkit writes extra/modelkit.json)
    data/aotinductor/...                 AOTInductor packages: compiled shared libraries (never read here)
An entry with `use_pickle: true` is a torch.save pickle (a tensor subclass): not read here. Standard library only.
"""
from __future__ import annotations

import json
import os
import re

from modelkit.errors import ParseError
from modelkit.parse import zipdir
from modelkit.parse.torch_format import (
    DTYPE_BITS,
    StorageRef,
    TensorRecord,
    TorchFile,
    check_views,
    map_file,
    storage_record,
)

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

__all__ = ["ARCHIVE_FORMAT", "DTYPE_CODES", "PT2File", "Program", "parse", "read", "root_of"]

ARCHIVE_FORMAT = b"pt2"
VERSIONS = ("0",)                     # archive versions this reader knows
WEIGHTS, CONSTANTS = "data/weights/", "data/constants/"
AOTI_DIR = "data/aotinductor/"
# torch/_export/serde/schema.py ScalarType -> torch dtype name
DTYPE_CODES: dict[int, str] = {
    1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float16", 7: "float32", 8: "float64",
    9: "complex32", 10: "complex64", 11: "complex128", 12: "bool", 13: "bfloat16", 28: "uint16",
    29: "float8_e4m3fn", 30: "float8_e5m2", 31: "float8_e4m3fnuz", 32: "float8_e5m2fnuz", 33: "float8_e8m0fnu",
    34: "uint32", 35: "uint64",
}
_JSON_LIMIT = 256 << 20               # a program's JSON: a few MB for real models
_SMALL = 1 << 16
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
_SYMBOL = re.compile(r"Symbol\('(\w+)'")
_MAX_DIMS = 64


def root_of(names: list[str]) -> str | None:
    """The folder of a PT2 archive (the one holding `archive_format` and models/), from member names only."""
    for name in names:
        root, _, rest = name.partition("/")
        if rest == "archive_format" and any(n.startswith(f"{root}/models/") and n.endswith(".json") for n in names):
            return root
    return None


class Program:
    """One exported program of the archive, as its JSON says (nothing of it is run).

    Attributes:
        name: the model's name in the archive ("model" for torch.export.save).
        inputs / outputs: user inputs and outputs: {"name", "dtype", "shape"} with each dim an int or a
            symbol name (a dynamic dimension).
        dynamic: symbol -> {"min": int | None, "max": int | None} (range_constraints).
        parameters / buffers / constants: state names in the order of the signature.
        targets: every node target, in order of first appearance ("torch.ops.aten.linear.default").
        schema_version, torch_version: what wrote it.
    """

    def __init__(self, name: str, value: dict[str, Any]) -> None:
        self.name = name
        module = _dict(value.get("graph_module"), "graph_module")
        graph = _dict(module.get("graph"), "graph_module.graph")
        signature = _dict(module.get("signature"), "graph_module.signature")
        values = _dict(graph.get("tensor_values", {}), "graph.tensor_values")
        version = value.get("schema_version") or {}
        self.schema_version = f"{version.get('major')}.{version.get('minor')}" if isinstance(version, dict) else "?"
        self.torch_version = str(value.get("torch_version", ""))[:64]
        self.parameters: list[str] = []
        self.buffers: list[str] = []
        self.constants: list[str] = []
        self.inputs: list[dict[str, Any]] = []
        self.outputs: list[dict[str, Any]] = []
        for spec in _list(signature.get("input_specs", []), "signature.input_specs"):
            kind, body = _one(spec, "an input spec")
            if kind == "parameter":
                self.parameters.append(str(body.get("parameter_name")))
            elif kind == "buffer":
                self.buffers.append(str(body.get("buffer_name")))
            elif kind in ("tensor_constant", "custom_obj", "constant_input"):
                self.constants.append(str(body.get(f"{kind}_name", body.get("name", kind))))
            elif kind == "user_input":
                self.inputs.append(_argument(body.get("arg"), values))
        for spec in _list(signature.get("output_specs", []), "signature.output_specs"):
            kind, body = _one(spec, "an output spec")
            if kind == "user_output":
                self.outputs.append(_argument(body.get("arg"), values))
        ranges = _dict(value.get("range_constraints", {}), "range_constraints")
        self.dynamic = {str(k): {"min": _bound(r, "min_val"), "max": _bound(r, "max_val")} for k, r in ranges.items()}
        targets: dict[str, None] = {}
        for node in _list(graph.get("nodes", []), "graph.nodes"):
            target = _dict(node, "a graph node").get("target")
            if not isinstance(target, str):
                raise ParseError("a graph node has no string target")
            targets.setdefault(target)
        self.targets = list(targets)

    def summary(self) -> dict[str, Any]:
        """What `modelkit inspect` shows of the program."""
        return {"name": self.name, "inputs": self.inputs, "outputs": self.outputs, "dynamic": self.dynamic,
                "parameters": len(self.parameters), "buffers": len(self.buffers), "constants": len(self.constants),
                "nodes": len(self.targets), "schema_version": self.schema_version, "torch_version": self.torch_version}


class PT2File:
    """A parsed PT2 archive. Build it with `read(path)` (or `parse(buf)`).

    Attributes:
        source: the file's path, for messages.
        root: the archive's folder.
        version: its archive_version.
        program: the exported program (models/model.json, or the archive's only one).
        weights / constants: fqn -> TensorRecord, in the configs' order; bytes through `file.array(record)`.
        pickled: fqn -> member of entries torch would unpickle (tensor subclasses, custom and opaque objects).
        extra: names of the extra/ files (`read_extra` gives one's bytes).
        aoti: members under data/aotinductor/ (compiled code: this reader never touches them).
        file: the TorchFile giving each record's bytes (views of the mapped file).
    """

    def __init__(self, source: str, root: str, version: str, program: Program, file: TorchFile,
                 weights: dict[str, TensorRecord], constants: dict[str, TensorRecord], pickled: dict[str, str],
                 extra: dict[str, zipdir.ZipEntry], aoti: list[str], buf: Any) -> None:
        self.source, self.root, self.version, self.program, self.file = source, root, version, program, file
        self.weights, self.constants, self.pickled, self.aoti = weights, constants, pickled, aoti
        self._extra, self._buf = extra, buf

    @property
    def extra(self) -> list[str]:
        """The names of the extra/ files."""
        return list(self._extra)

    def read_extra(self, name: str, limit: int) -> bytes | None:
        """An extra/ file's bytes; None when the archive has none of that name.

        Raises:
            ParseError: larger than `limit`, or a member that cannot be read.
        """
        entry = self._extra.get(name)
        return None if entry is None else _member_bytes(self._buf, entry, limit)


def read(path: str | os.PathLike[str]) -> PT2File:
    """Parse the PT2 archive at `path`; no tensor bytes are read yet, nothing is unpickled.

    Raises:
        ParseError: not a PT2 archive, an archive version this reader does not know, malformed JSON, a
            config naming members that are missing or not plain names, views outside their storages
            (naming the file; OSError when it cannot be opened).
    """
    return parse(map_file(path, "a PT2 archive"), source=os.fspath(path))


def parse(buf, *, source: str = "<bytes>") -> PT2File:
    """Parse a PT2 archive held in `buf` (bytes or an mmap); see `read`."""
    try:
        return _parse(buf, source)
    except ParseError as e:
        raise e if e.source else ParseError(e.reason, source=source) from None
    except RecursionError:
        raise ParseError("the archive's JSON nests too deeply", source=source) from None


def _parse(buf, source: str) -> PT2File:
    if bytes(buf[:4]) != b"PK\x03\x04":
        raise ParseError("not a zip archive, so not a PT2 archive")
    entries = {e.filename: e for e in zipdir.read_directory(buf)}     # of duplicate names, the last (as zipfile)
    root = root_of(list(entries))
    if root is None:
        raise ParseError("not a PT2 archive (needs <folder>/archive_format and <folder>/models/<name>.json)")

    def small(member: str, limit: int = _SMALL) -> bytes:
        return _member_bytes(buf, entries[f"{root}/{member}"], limit)

    if small("archive_format").strip() != ARCHIVE_FORMAT:
        raise ParseError("archive_format does not say 'pt2'")
    version = small("archive_version").decode("ascii", "replace").strip() if f"{root}/archive_version" in entries else "0"
    if version not in VERSIONS:
        raise ParseError(f"PT2 archive version {version[:20]!r}; this reader knows version(s) {', '.join(VERSIONS)}: "
                         "a newer torch wrote it (read it with that torch's torch.export.load)")
    if f"{root}/byteorder" in entries and small("byteorder").strip() not in (b"", b"little"):
        raise ParseError("the archive was written on a big-endian machine; modelkit reads little-endian only")
    models = sorted(n[len(root) + 8:-5] for n in entries if n.startswith(f"{root}/models/") and n.endswith(".json"))
    name = "model" if "model" in models else models[0]
    if len(models) > 1 and name != "model":
        raise ParseError(f"the archive holds {len(models)} programs ({', '.join(models[:4])}); modelkit reads one")
    program = Program(name, _json(small(f"models/{name}.json", _JSON_LIMIT), f"models/{name}.json"))
    records: dict[str, Any] = {}
    file = TorchFile(buf, source, "pt2", None, None, records, "little")
    pickled: dict[str, str] = {}
    weights = _payload(buf, entries, root, WEIGHTS, f"{name}_weights_config.json", file, records, pickled)
    constants = _payload(buf, entries, root, CONSTANTS, f"{name}_constants_config.json", file, records, pickled)
    file.tensors.extend([*weights.values(), *constants.values()])
    check_views(file.storages, file.tensors, records)
    extra = {n[len(root) + 7:]: e for n, e in entries.items() if n.startswith(f"{root}/extra/") and not n.endswith("/")}
    aoti = [n for n in entries if n.startswith(f"{root}/{AOTI_DIR}")]
    return PT2File(source, root, version, program, file, weights, constants, pickled, extra, aoti, buf)


def _payload(buf, entries: dict[str, zipdir.ZipEntry], root: str, folder: str, config_name: str, file: TorchFile,
             records_of: dict[str, Any], pickled: dict[str, str]) -> dict[str, TensorRecord]:
    """The records a weights or constants config describes; their storages join `file` (and `records_of`)."""
    member = f"{root}/{folder}{config_name}"
    if member not in entries:
        if f"{root}/{folder}model.pt" in entries:
            raise ParseError(f"{folder}model.pt: a legacy PT2 layout (a pickled state); re-save it with "
                             "torch.export.save of torch 2.6 or newer")
        return {}
    config = _dict(_json(_member_bytes(buf, entries[member], _JSON_LIMIT), member).get("config"), f"{config_name} config")
    records: dict[str, TensorRecord] = {}
    for fqn, meta in config.items():
        meta = _dict(meta, f"{config_name} entry {fqn!r}")
        path_name = meta.get("path_name")
        if not isinstance(path_name, str) or not _PLAIN_NAME.fullmatch(path_name) or ".." in path_name:
            raise ParseError(f"{config_name}: entry {fqn!r} names {str(path_name)[:80]!r}, not a plain member name")
        name = f"{root}/{folder}{path_name}"
        if name not in entries:
            raise ParseError(f"{config_name}: entry {fqn!r} names {folder}{path_name}, which the archive lacks")
        if meta.get("use_pickle") or not path_name.startswith(("weight_", "tensor_")):
            pickled[fqn] = name
            continue
        tensor_meta = _dict(meta.get("tensor_meta"), f"{config_name} entry {fqn!r} tensor_meta")
        code = tensor_meta.get("dtype")
        dtype = DTYPE_CODES.get(code) if isinstance(code, int) and not isinstance(code, bool) else None
        if dtype is None:
            raise ParseError(f"{config_name}: entry {fqn!r} has dtype code {str(code)[:20]}, which modelkit does not know")
        if tensor_meta.get("layout", 7) != 7:
            raise ParseError(f"{config_name}: entry {fqn!r} is not a strided tensor (layout {tensor_meta.get('layout')})")
        size = _ints(tensor_meta.get("sizes"), f"{fqn!r} sizes")
        stride = _ints(tensor_meta.get("strides"), f"{fqn!r} strides")
        offset = _ints([tensor_meta.get("storage_offset")], f"{fqn!r} storage_offset")[0]
        if len(size) != len(stride) or len(size) > _MAX_DIMS:
            raise ParseError(f"{config_name}: entry {fqn!r} has {len(size)} sizes and {len(stride)} strides")
        key = f"{folder[5:]}{path_name}"        # weights/weight_0: the record's name under data/
        storage = file.storages.get(key)
        if storage is None:
            entry = entries[name]
            itemsize = int(DTYPE_BITS[dtype][2:])
            if entry.file_size % itemsize:
                raise ParseError(f"{folder}{path_name} holds {entry.file_size} bytes, not whole {dtype} elements")
            storage = StorageRef(key, dtype, entry.file_size // itemsize, "cpu", False)
            file.storages[key] = storage
            records_of[key] = storage_record(buf, entry, f"{folder}{path_name}")
        elif storage.dtype != dtype:
            raise ParseError(f"{folder}{path_name} is read as {storage.dtype} and as {dtype} by two entries")
        records[str(fqn)] = TensorRecord(storage, dtype, offset, size, stride,
                                         bool(tensor_meta.get("requires_grad")), bool(meta.get("is_param")))
    return records


def _member_bytes(buf, entry: zipdir.ZipEntry, limit: int) -> bytes:
    if entry.file_size > limit:
        raise ParseError(f"{entry.filename} is {entry.file_size} bytes; refusing more than {limit}")
    data = zipdir.read_start(buf, entry, entry.file_size)
    if len(data) != entry.file_size:
        raise ParseError(f"{entry.filename} does not inflate to its size in the zip directory")
    return data


def _json(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ParseError(f"{what} is not valid JSON ({e})") from None
    return _dict(value, what)


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ParseError(f"{what} is not a JSON object")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ParseError(f"{what} is not a JSON list")
    return value


def _one(spec: Any, what: str) -> tuple[str, dict[str, Any]]:
    """A schema union: an object with one key naming the member that is set."""
    spec = _dict(spec, what)
    if len(spec) != 1:
        raise ParseError(f"{what} sets {len(spec)} fields of a union, not one")
    (kind, body), = spec.items()
    return kind, _dict(body, f"{what} {kind!r}")


def _ints(values: Any, what: str) -> tuple[int, ...]:
    """Sizes or strides stored as [{"as_int": n}]; a symbolic one (as_expr) is not a stored tensor's."""
    out = []
    for v in _list(values, what):
        n = v.get("as_int") if isinstance(v, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < 1 << 62:
            raise ParseError(f"{what}: {str(v)[:60]} is not a non-negative integer")
        out.append(n)
    return tuple(out)


def _bound(value: Any, key: str) -> int | None:
    v = value.get(key) if isinstance(value, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) and abs(v) < 1 << 62 else None


def _argument(arg: Any, values: dict[str, Any]) -> dict[str, Any]:
    """A user input or output: its name, dtype and shape (a symbol's name for a dynamic dimension)."""
    kind, body = _one(arg, "an argument")
    name = str(body.get("name", kind)) if kind == "as_tensor" else kind
    meta = values.get(name) if kind == "as_tensor" else None
    if not isinstance(meta, dict):
        return {"name": name, "dtype": None, "shape": None}
    shape: list[int | str] = []
    for dim in _list(meta.get("sizes", []), f"{name} sizes")[:_MAX_DIMS]:
        dim = _dict(dim, f"a size of {name}")
        if isinstance(dim.get("as_int"), int):
            shape.append(dim["as_int"])
        else:
            expr = str(_dict(dim.get("as_expr", {}), "a symbolic size").get("expr_str", "?"))
            match = _SYMBOL.match(expr)
            shape.append(match.group(1) if match else expr[:40])
    code = meta.get("dtype")
    return {"name": name, "dtype": DTYPE_CODES.get(code) if isinstance(code, int) else None, "shape": shape}
