"""torchscript: a module compiled by torch.jit.script (or traced) and saved by torch.jit.save.

Spec: https://pytorch.org/docs/stable/jit.html; the archive is written by torch/csrc/jit/serialization
(export_module.cpp) and read by import.cpp. torch 2.13 deprecates TorchScript; see
docs/formats/torchscript.md for what that means here.
Layout: a zip archive whose members sit under one folder `<archive>/`:
    data.pkl             the module tree: each object is NEWOBJ of a `__torch__.<qualified class>`
                         plus BUILD with its attribute dict; tensors as torch.save writes them,
                         `_rebuild_tensor_v2(<persistent id>, offset, size, stride, ...)` with the
                         persistent id ('storage', type, key, location, numel)
    data/<key>           raw little-endian storage bytes, stored uncompressed
    constants.pkl        tensors baked into the code (e.g. by tracing)
    code/__torch__/...   the TorchScript source of every class (and .debug_pkl source maps)
    extra/<name>         `_extra_files`: modelkit writes extra/modelkit.json (layout below)
    version | byteorder | .data/serialization_id
extra/modelkit.json: {"format": "modelkit.torchscript/1", "export": "script" | "trace",
    "arch": ArchSpec JSON or null, "metadata": {str: str}, "state_dict": [names in order]}

Reading weights runs no TorchScript: data.pkl goes through a restricted unpickler that knows
only tensor rebuilding and stands an inert placeholder in for every `__torch__` class, and each
tensor's bytes are read from its zip member when it is loaded. `runnable` is the one place that
calls torch.jit.load, which compiles and runs the archive's code, so it needs trust.
"""
from __future__ import annotations

import io
import json
import logging
import pickle
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from modelkit.checkpoint import ALIASES_KEY, ArchSpec, Checkpoint, LazyTensor
from modelkit.errors import FormatError, ParseError, UnsupportedConversionError
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.metadata import TORCHSCRIPT_EXPORT_KEY, TORCHSCRIPT_EXTRA
from modelkit.parse import zipdir
from modelkit.parse.detect import torchscript as detect  # noqa: F401  (the converter's detect)
from modelkit.parse.detect import torchscript_prefix
from modelkit.storage.dtypes import DTYPES, LEGACY_STORAGE_DTYPES, DType, as_dtype

logger = logging.getLogger(__name__)

EXTRA_NAME = TORCHSCRIPT_EXTRA
EXPORT_KEY = TORCHSCRIPT_EXPORT_KEY
_LAYOUT = "modelkit.torchscript/1"
_PICKLE_LIMIT = 256 << 20                      # data.pkl of real models is a few MB at most
_EXTRA_LIMIT = 16 << 20
_MAX_DEPTH = 100                               # module nesting; deeper means a malformed tree
_MAX_VISITS = 1_000_000                        # module paths walked (shared submodules count once per path)
# torch.jit.script/trace/save/load each warn "`torch.jit.X` is deprecated" in torch 2.13; the user
# asked for this format and docs/formats/torchscript.md records the deprecation, so modelkit does
# not repeat it on every call. Other warnings (Python 3.14 "may break") pass through.
_DEPRECATED = r"`torch\.jit\.\w+` is deprecated"
# Storage classes data.pkl may name -> element dtype (torch.storage._dtype_to_storage_type_map).





def _gate(path: Path, *, running_code: bool, trust: bool) -> str:
    """The scanner's gate: scan `path` before anything unpickles it; returns what it checked.

    Dangerous content (pickles that call the OS, code in code/ that reaches it) is refused with
    UnsafeFileError(path, report) even with trust. Every archive holds code, which needs trust
    only when it will run (`runnable`): reading the weights goes through the restricted
    unpickler below and runs nothing.
    """
    from modelkit.scan import gate

    report = gate(path, trust=trust or not running_code)
    return f"scanned, {len(report.findings)} finding(s), none dangerous"


# ---- reading weights without running anything -------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Storage:
    key: str
    dtype: DType
    numel: int                    # elements of `dtype`


@dataclass(frozen=True, slots=True)
class _TensorRef:
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: DType


class _ScriptObject:
    """An inert stand-in for a `__torch__.*` object: keeps the state it is given, runs nothing."""

    qualname = "__torch__.<object>"

    def __init__(self, *args: Any) -> None:
        self.state: Any = args or None

    def __setstate__(self, state: Any) -> None:
        self.state = state


@dataclass(frozen=True, slots=True)
class _StorageType:
    dtype: DType


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> _TensorRef:
    return _TensorRef(storage, offset, size, stride, getattr(storage, "dtype", None))


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any,
                *_: Any) -> _TensorRef:
    return _TensorRef(storage, offset, size, stride, dtype)


def _same(value: Any, *_: Any) -> Any:
    return value


# The only callables data.pkl can reach; each builds a reference or returns its argument.
_ALLOWED: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch._utils", "_rebuild_parameter"): _same,
    ("collections", "OrderedDict"): OrderedDict,
    ("torch.jit._pickle", "restore_type_tag"): _same,
    **{("torch.jit._pickle", f"build_{kind}list"): _same for kind in ("int", "float", "bool", "tensor", "double")},
}


class _Refused(Exception):
    """data.pkl names a global the weights reader does not accept."""


class _WeightsUnpickler(pickle._Unpickler):  # the pure-Python unpickler: its memo is a dict, not an array
    """Rebuilds data.pkl as placeholders and tensor references; find_class is the only way to a callable."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._classes: dict[str, type[_ScriptObject]] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "__torch__" or module.startswith("__torch__."):
            qualname = f"{module}.{name}"
            if qualname not in self._classes:
                self._classes[qualname] = type("ScriptObject", (_ScriptObject,), {"qualname": qualname})
            return self._classes[qualname]
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module == "torch" and name in LEGACY_STORAGE_DTYPES:
            return _StorageType(LEGACY_STORAGE_DTYPES[name])
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return _StorageType(DTYPES["uint8"])
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype) and name in DTYPES:
            return as_dtype(getattr(torch, name))
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        ok = (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)
              and isinstance(pid[2], str) and isinstance(pid[4], int) and pid[4] >= 0)
        if not ok:
            raise pickle.UnpicklingError(f"unexpected persistent id {str(pid)[:100]}")
        return _Storage(pid[2], pid[1].dtype, pid[4])


class _Archive:
    """The archive's directory (modelkit.parse.zipdir, as the scanner reads it); members are read on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.zip = zipdir.Archive(path)
        except (OSError, ParseError) as e:
            raise FormatError(path, f"not a readable zip archive ({e})") from e
        prefix = torchscript_prefix(list(self.zip.entries))
        if prefix is None:
            raise FormatError(path, "not a TorchScript archive (needs data.pkl, constants.pkl and code/ in one folder)")
        self.prefix = prefix

    def read(self, member: str, limit: int | None = None) -> bytes:
        name = f"{self.prefix}/{member}"
        try:
            return self.zip.read(name, limit)                # checks the size and the CRC
        except KeyError as e:
            raise FormatError(self.path, f"cannot read {member} (no such member)") from e
        except (OSError, ParseError) as e:
            raise FormatError(self.path, f"cannot read {member} ({e})") from e

    def has(self, member: str) -> bool:
        return f"{self.prefix}/{member}" in self.zip.entries

    def record_size(self, key: str) -> int | None:
        entry = self.zip.entries.get(f"{self.prefix}/data/{key}")
        if entry is None:
            return None
        if entry.compress_type != zipdir.STORED:
            raise FormatError(self.path, f"tensor data data/{key} is compressed; torch.jit.save never does that")
        return entry.file_size


def read(path: Path, options: ReadOptions = ReadOptions()) -> Checkpoint:
    """The archive's weights and modelkit's metadata, without running its code (no trust needed)."""
    _gate(path, running_code=False, trust=options.trust)
    return _read(_Archive(path))


def _read(archive: _Archive) -> Checkpoint:
    path = archive.path
    if archive.has("byteorder") and archive.read("byteorder", limit=16).strip() not in (b"", b"little"):
        raise FormatError(path, "the archive was written on a big-endian machine; modelkit reads little-endian only")
    root = _unpickle(archive)
    info = _modelkit_info(archive)
    refs = _tensor_refs(path, root)
    names = info.get("state_dict")
    if names is None:                               # not written by modelkit: every tensor attribute
        names = list(refs)
    missing = [n for n in names if n not in refs]
    if missing:
        raise FormatError(path, f"tensor {missing[0]!r} listed in extra/{EXTRA_NAME} is not in data.pkl")
    tensors = {name: _lazy(archive, name, refs[name]) for name in names}
    metadata = dict(info.get("metadata", {}))
    if "export" in info:
        metadata[EXPORT_KEY] = info["export"]
    ties = _ties({n: refs[n] for n in names})
    if ties and ALIASES_KEY not in metadata:
        metadata[ALIASES_KEY] = json.dumps(ties, sort_keys=True)
    arch = ArchSpec.from_json(info["arch"], source=path) if info.get("arch") is not None else None
    return Checkpoint(tensors=tensors, metadata=metadata, arch=arch)


def _unpickle(archive: _Archive) -> _ScriptObject:
    data = archive.read("data.pkl", limit=_PICKLE_LIMIT)
    try:
        root = _WeightsUnpickler(data).load()
    except _Refused as e:
        raise FormatError(archive.path, f"data.pkl names {e}, which the weights-only reader does not accept "
                                        "(quantized or custom-class attributes are not supported)") from e
    except Exception as e:  # the unpickler raises many types on malformed input; none may escape
        raise FormatError(archive.path, f"data.pkl is malformed ({type(e).__name__}: {_first_line(e)})") from e
    if not isinstance(root, _ScriptObject) or not isinstance(root.state, dict):
        raise FormatError(archive.path, "data.pkl does not hold a module")
    return root


def _tensor_refs(path: Path, root: _ScriptObject) -> dict[str, _TensorRef]:
    """Dotted attribute path -> tensor, through the module tree (the state_dict's names)."""
    refs: dict[str, _TensorRef] = {}
    # (object, name prefix, ancestors): shared submodules appear under each name, as in state_dict
    todo: list[tuple[_ScriptObject, str, frozenset[int]]] = [(root, "", frozenset())]
    visits = 0
    while todo:
        obj, prefix, ancestors = todo.pop()
        visits += 1
        if len(ancestors) > _MAX_DEPTH or visits > _MAX_VISITS:   # a crafted tree of shared modules could
            raise FormatError(path, f"the module tree is deeper than {_MAX_DEPTH} levels or has more than "
                                    f"{_MAX_VISITS} module paths")   # multiply paths exponentially
        state = obj.state if isinstance(obj.state, dict) else {}
        children = []
        for key, value in state.items():
            if not isinstance(key, str):
                continue
            if isinstance(value, _TensorRef):
                refs[f"{prefix}{key}"] = value
            elif isinstance(value, _ScriptObject) and id(value) not in ancestors:
                children.append((value, f"{prefix}{key}.", ancestors | {id(obj)}))
        todo.extend(reversed(children))             # depth first, in attribute order
    return refs


def _lazy(archive: _Archive, name: str, ref: _TensorRef) -> LazyTensor:
    """Check a reference against its zip member, then read the bytes only when loaded."""
    path = archive.path
    storage = ref.storage
    ok = (isinstance(storage, _Storage) and isinstance(ref.dtype, DType) and isinstance(ref.offset, int)
          and isinstance(ref.size, tuple) and isinstance(ref.stride, tuple) and len(ref.size) == len(ref.stride)
          and all(isinstance(v, int) and v >= 0 for v in (ref.offset, *ref.size, *ref.stride)))
    if not ok:
        raise FormatError(path, f"tensor {name!r} has a malformed reference in data.pkl")
    nbytes = storage.numel * storage.dtype.itemsize
    if archive.record_size(storage.key) != nbytes:
        raise FormatError(path, f"tensor {name!r}: storage data/{storage.key} is missing or not {nbytes} bytes")
    if nbytes % ref.dtype.itemsize:
        raise FormatError(path, f"tensor {name!r}: {nbytes} storage bytes do not hold whole {ref.dtype} elements")
    elements = nbytes // ref.dtype.itemsize
    numel = 1
    for s in ref.size:
        numel *= s
    extent = ref.offset + sum((s - 1) * st for s, st in zip(ref.size, ref.stride, strict=True)) + 1
    if numel and extent > elements:
        raise FormatError(path, f"tensor {name!r} reaches element {extent} of a storage of {elements}")

    def load() -> torch.Tensor:
        data = archive.read(f"data/{storage.key}")
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return flat.view(ref.dtype.torch).as_strided(ref.size, ref.stride, ref.offset)

    return LazyTensor(ref.dtype, ref.size, load, f"{path}:{name}")


def _ties(refs: dict[str, _TensorRef]) -> dict[str, str]:
    """Names that are the very same view of one storage as an earlier name (tied weights)."""
    first: dict[tuple[Any, ...], str] = {}
    ties = {}
    for name, ref in refs.items():
        identity = (ref.storage.key, ref.offset, ref.size, ref.stride, ref.dtype)
        if identity in first and all(ref.size):
            ties[name] = first[identity]
        first.setdefault(identity, name)
    return ties


def _modelkit_info(archive: _Archive) -> dict[str, Any]:
    """extra/modelkit.json, checked; {} for archives modelkit did not write."""
    member = f"extra/{EXTRA_NAME}"
    if not archive.has(member):
        return {}
    try:
        info = json.loads(archive.read(member, limit=_EXTRA_LIMIT))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(archive.path, f"{member} is not valid JSON ({e})") from e
    metadata = info.get("metadata", {}) if isinstance(info, dict) else None
    names = info.get("state_dict", []) if isinstance(info, dict) else None
    ok = (isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
          and isinstance(names, list) and all(isinstance(n, str) for n in names)
          and isinstance(info.get("arch"), str | None) and info.get("export", "script") in ("script", "trace"))
    if not ok:
        raise FormatError(archive.path, f'{member} must look like {{"metadata": {{str: str}}, "arch": JSON or null, '
                                        '"state_dict": [names], "export": "script" | "trace"}')
    return info


def runnable(path: Path, options: ReadOptions = ReadOptions()) -> Callable[..., torch.Tensor]:
    """The archive's own ScriptModule, for verification. torch.jit.load runs its code: needs trust."""
    if not options.trust:
        raise UnsupportedConversionError(
            str(path), "a runnable model",
            "running a TorchScript archive executes the code inside it; pass --trust (API: trust=True) if you "
            "trust its source (its weights read without trust: modelkit.load, or modelkit.load_module to rebuild "
            "the model from its ArchSpec)",
        )
    gate = _gate(path, running_code=True, trust=options.trust)
    logger.info("%s: running the archive's code with torch.jit.load because trust was given; scanner gate: %s",
                path, gate)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DEPRECATED, category=DeprecationWarning)
            module = torch.jit.load(str(path), map_location="cpu")
    except Exception as e:  # torch.jit.load raises RuntimeError and friends on bad archives
        raise FormatError(path, f"torch.jit.load failed ({type(e).__name__}: {_first_line(e)})") from e
    return module.eval()


# ---- writing ----------------------------------------------------------------------------------

def write(ckpt: Checkpoint, path: Path, options: WriteOptions = WriteOptions()) -> None:
    """Script the module (trace it when scripting fails) and save it with modelkit.json inside.

    The module is `options.module`, else rebuilt from the checkpoint's ArchSpec. torch.jit.save
    needs the whole module in memory and builds the archive in memory before writing it.
    """
    from modelkit.checkpoint import instantiate

    module = options.module
    if module is None:
        module = instantiate(ckpt, source="the checkpoint", target="torchscript", dequantize=True)
    compiled, how = _compile(module, options)
    info = {
        "format": _LAYOUT, "export": how,
        "arch": ckpt.arch.to_json() if ckpt.arch is not None else None,
        "metadata": {k: v for k, v in ckpt.metadata.items() if k != EXPORT_KEY},
        "state_dict": list(module.state_dict()),
    }
    extra = {EXTRA_NAME: json.dumps(info, sort_keys=True)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATED, category=DeprecationWarning)
        # A file object, not a path: with a path torch names the zip's folder after the
        # temporary file; with a file object it is always "archive".
        with path.open("wb") as f:
            torch.jit.save(compiled, f, _extra_files=extra)


def _compile(module: torch.nn.Module, options: WriteOptions) -> tuple[torch.jit.ScriptModule, str]:
    """(compiled module, "script" | "trace"): script first; trace when the compiler refuses."""
    name = type(module).__name__
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATED, category=DeprecationWarning)
        try:
            compiled = torch.jit.script(module)
            logger.info("%s: scripted with torch.jit.script", name)
            return compiled, "script"
        except Exception as e:  # TorchScript's compiler raises RuntimeError, NotSupportedError, ...
            reason = _first_line(e)
    inputs = _example_inputs(module, options)
    if inputs is None:
        raise UnsupportedConversionError(name, "torchscript", f"torch.jit.script failed ({reason}) and there are no "
                                         "example inputs to trace it with; pass example_inputs")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            traced = torch.jit.trace(module, inputs)
        except Exception as e:  # tracing runs the model: any error of the model's own
            raise UnsupportedConversionError(name, "torchscript", f"torch.jit.script failed ({reason}) and so did "
                                             f"torch.jit.trace ({_first_line(e)})") from e
    tracer = sorted({_first_line(w.message).split(". ")[0] for w in caught if issubclass(w.category, torch.jit.TracerWarning)})
    for w in caught:
        if not issubclass(w.category, (torch.jit.TracerWarning, DeprecationWarning)):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    logger.warning("%s: torch.jit.script failed (%s); traced it with example inputs instead, so control flow "
                   "is fixed to the path those inputs took%s", name, reason,
                   f" (tracer: {'; '.join(tracer)})" if tracer else "")
    return traced, "trace"


def _example_inputs(module: torch.nn.Module, options: WriteOptions) -> tuple[Any, ...] | None:
    if options.example_inputs is not None:
        return tuple(options.example_inputs)
    from modelkit.models import MODELS, load_model_module

    arch = getattr(type(module), "arch", None)
    if arch not in MODELS:
        return None
    inputs = load_model_module(arch).example_inputs()
    return inputs if isinstance(inputs, tuple) else (inputs,)


def _first_line(error: Any) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:200] if lines else type(error).__name__
