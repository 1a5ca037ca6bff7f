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
    "arch": ArchSpec JSON or null, "metadata": {str: str}, "state_dict": [names in order],
    "prefix": where those names are in data.pkl when the module was wrapped (a causal LM's graph: "model.")}

Reading weights runs no TorchScript and needs no torch: modelkit.parse.torch_format reads data.pkl
symbolically (never unpickled; each `__torch__` object a ScriptObject of its class name and attribute
dict), checks every storage and view against its zip record, and gives each tensor's bytes as a view of
the mapped file when it is loaded. `runnable` is the one place that calls torch.jit.load, which compiles
and runs the archive's code, so it needs trust; it and `write` import torch when called.
"""
from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelkit.checkpoint import ALIASES_KEY, ArchSpec, Checkpoint, LazyTensor
from modelkit.errors import FormatError, ParseError, UnsupportedConversionError
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.metadata import TORCHSCRIPT_EXPORT_KEY, TORCHSCRIPT_EXTRA
from modelkit.parse import torch_format, zipdir
from modelkit.parse.detect import torchscript as detect  # noqa: F401  (the converter's detect)
from modelkit.parse.detect import torchscript_prefix
from modelkit.parse.torch_format import ScriptObject, TensorRecord
from modelkit.storage.dtypes import DTYPES
from modelkit.storage.mapped import FileSpan

if TYPE_CHECKING:
    import torch

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


def _gate(path: Path, *, running_code: bool, trust: bool) -> str:
    """The scanner's gate: scan `path` before anything unpickles it; returns what it checked.

    Dangerous content (pickles that call the OS, code in code/ that reaches it) is refused with
    UnsafeFileError(path, report) even with trust. Every archive holds code, which needs trust
    only when it will run (`runnable`): reading the weights goes through modelkit.parse.torch_format
    and runs nothing.
    """
    from modelkit.scan import gate

    report = gate(path, trust=trust or not running_code)
    return f"scanned, {len(report.findings)} finding(s), none dangerous"


# ---- reading weights without running anything -------------------------------------------------

# Globals data.pkl may name beyond `__torch__.*` classes, storage classes and dtypes: what a module's
# weights are rebuilt with. Anything else (quantized tensors, custom classes, a call of the OS) is refused.
_ACCEPTED = frozenset({
    "torch._utils._rebuild_tensor", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
    "torch._utils._rebuild_parameter", "collections.OrderedDict", "torch.jit._pickle.restore_type_tag",
    *(f"torch.jit._pickle.build_{kind}list" for kind in ("int", "float", "bool", "tensor", "double")),
})


def _accepted(name: str) -> bool:
    module, _, attr = name.rpartition(".")
    return (name in _ACCEPTED or module == "__torch__" or module.startswith("__torch__.")
            or (module in ("torch", "torch.storage") and attr in torch_format.STORAGE_DTYPES)
            or (module == "torch" and attr in DTYPES))


class _Archive:
    """The archive's directory (modelkit.parse.zipdir, as the scanner reads it), for its small members."""

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


def read(path: Path, options: ReadOptions = ReadOptions()) -> Checkpoint:
    """The archive's weights and modelkit's metadata, without running its code (no trust needed)."""
    _gate(path, running_code=False, trust=options.trust)
    return _read(_Archive(path))


def _read(archive: _Archive) -> Checkpoint:
    path = archive.path
    if archive.has("byteorder") and archive.read("byteorder", limit=16).strip() not in (b"", b"little"):
        raise FormatError(path, "the archive was written on a big-endian machine; modelkit reads little-endian only")
    parsed = _parse(path)
    info = _modelkit_info(archive)
    records = _tensor_records(path, parsed.value)
    names = info.get("state_dict")
    prefix = info.get("prefix", "")                 # the module's weights under a wrapper (a causal LM's graph)
    if names is None:                               # not written by modelkit: every tensor attribute
        names = list(records)
    missing = [n for n in names if prefix + n not in records]
    if missing:
        raise FormatError(path, f"tensor {missing[0]!r} listed in extra/{EXTRA_NAME} is not in data.pkl")
    records = {name: records[prefix + name] for name in names}
    tensors = {name: _lazy(path, parsed, name, records[name]) for name in names}
    metadata = dict(info.get("metadata", {}))
    if "export" in info:
        metadata[EXPORT_KEY] = info["export"]
    ties = torch_format.tied_names({n: records[n] for n in names})
    if ties and ALIASES_KEY not in metadata:
        metadata[ALIASES_KEY] = json.dumps(ties, sort_keys=True)
    arch = ArchSpec.from_json(info["arch"], source=path) if info.get("arch") is not None else None
    return Checkpoint(tensors=tensors, metadata=metadata, arch=arch)


def _parse(path: Path) -> torch_format.TorchFile:
    """data.pkl's module tree, every storage and view checked against its record (ParseError names the file)."""
    try:
        parsed = torch_format.read_script(path)
    except OSError as e:
        raise FormatError(path, f"cannot read the file ({e})") from e
    refused = [name for name in parsed.globals if not _accepted(name)]
    if refused:
        raise FormatError(path, f"data.pkl names {refused[0]}, which the weights-only reader does not accept "
                                "(quantized or custom-class attributes are not supported)")
    if not isinstance(parsed.value, ScriptObject) or not isinstance(parsed.value.state, dict):
        raise FormatError(path, "data.pkl does not hold a module (a __torch__ object with an attribute dict)")
    return parsed


def _tensor_records(path: Path, root: ScriptObject) -> dict[str, TensorRecord]:
    """Dotted attribute path -> tensor, through the module tree (the state_dict's names)."""
    records: dict[str, TensorRecord] = {}
    # (object, name prefix, ancestors): shared submodules appear under each name, as in state_dict
    todo: list[tuple[ScriptObject, str, frozenset[int]]] = [(root, "", frozenset())]
    visits = 0
    opaque: set[int] = set()                        # objects without an attribute dict, looked into once
    while todo:
        obj, prefix, ancestors = todo.pop()
        visits += 1
        if len(ancestors) > _MAX_DEPTH or visits > _MAX_VISITS:   # a crafted tree of shared modules could
            raise FormatError(path, f"the module tree is deeper than {_MAX_DEPTH} levels or has more than "
                                    f"{_MAX_VISITS} module paths")   # multiply paths exponentially
        if not isinstance(obj.state, dict):
            if id(obj) not in opaque and _holds_tensor(obj.state):
                raise FormatError(path, f"module {prefix[:-1]!r} ({obj.qualname}) keeps its tensors in a "
                                        f"{type(obj.state).__name__} state of its own __getstate__, not in "
                                        "attributes; the weights-only reader reads attributes only")
            opaque.add(id(obj))
            continue
        children = []
        for key, value in obj.state.items():
            if not isinstance(key, str):
                continue
            if isinstance(value, TensorRecord):
                records[f"{prefix}{key}"] = value
            elif isinstance(value, ScriptObject) and id(value) not in ancestors:
                children.append((value, f"{prefix}{key}.", ancestors | {id(obj)}))
        todo.extend(reversed(children))             # depth first, in attribute order
    return records


def _holds_tensor(value: Any) -> bool:
    """Whether a plain value reaches a tensor; shared values are looked at once."""
    seen: set[int] = set()
    todo = [value]
    while todo:
        value = todo.pop()
        if isinstance(value, TensorRecord):
            return True
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            todo.extend(value.values())
        elif isinstance(value, (list, tuple, set)):
            todo.extend(value)
        elif isinstance(value, ScriptObject):
            todo.append(value.state)
    return False


def _lazy(path: Path, parsed: torch_format.TorchFile, name: str, record: TensorRecord) -> LazyTensor:
    """The tensor's bytes read when loaded (a view of the mapped file), and where they lie in it."""
    if record.dtype not in DTYPES:
        raise FormatError(path, f"tensor {name!r} is {record.dtype}, which modelkit does not read "
                                f"(it reads {', '.join(DTYPES)})")
    span = parsed.span(record)
    return LazyTensor(DTYPES[record.dtype], record.size, partial(parsed.array, record), f"{path}:{name}",
                      FileSpan(path, *span) if span is not None else None)


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
          and isinstance(info.get("arch"), str | None) and info.get("export", "script") in ("script", "trace")
          and isinstance(info.get("prefix", ""), str))
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
    import torch

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
    import torch

    from modelkit.checkpoint import instantiate
    from modelkit.testing import causal_lm

    module = options.module
    if module is None:
        module = instantiate(ckpt, source="the checkpoint", target="torchscript", dequantize=True)
    if causal_lm.is_causal_lm(module):
        # A Hugging Face causal LM: the ONNX graph's signature (input_ids, attention_mask, position_ids ->
        # logits), traced on token batches; transformers' modules do not script.
        if options.kv_cache:
            raise UnsupportedConversionError(type(module).__name__, "torchscript", "--kv-cache is an ONNX option")
        graph = causal_lm.graph(module, kv_cache=False)
        compiled, how = _trace(graph, causal_lm.export_inputs(module, kv_cache=False), None)
        prefix = "model."                          # CausalLMGraph.model
    else:
        compiled, how = _compile(module, options)
        prefix = ""
    info = {
        "format": _LAYOUT, "export": how,
        "arch": ckpt.arch.to_json() if ckpt.arch is not None else None,
        "metadata": {k: v for k, v in ckpt.metadata.items() if k != EXPORT_KEY},
        "state_dict": list(module.state_dict()),
        **({"prefix": prefix} if prefix else {}),
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
    import torch

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
                                         "example inputs to trace it with; pass --input-shape NAME=DIMS[:DTYPE] "
                                         "(API: example_inputs=...)")
    return _trace(module, inputs, f"torch.jit.script failed ({reason})")


def _trace(module: torch.nn.Module, inputs: tuple[Any, ...], why: str | None) -> tuple[torch.jit.ScriptModule, str]:
    """(traced module, "trace"); the tracer's warnings summarised in one log line. `why`: why scripting was
    not used, for the warning; None when tracing is the module's own way (a causal LM)."""
    import torch

    name = type(module).__name__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            traced = torch.jit.trace(module, inputs)
        except Exception as e:  # tracing runs the model: any error of the model's own
            raise UnsupportedConversionError(name, "torchscript", f"{why or 'tracing'}: torch.jit.trace failed "
                                             f"({_first_line(e)})") from e
    tracer = sorted({_first_line(w.message).split(". ")[0] for w in caught if issubclass(w.category, torch.jit.TracerWarning)})
    for w in caught:
        # FutureWarning: the traced library's notes about its own internals (transformers'), not the user's
        if not issubclass(w.category, (torch.jit.TracerWarning, DeprecationWarning, FutureWarning)):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    note = f" (tracer: {'; '.join(tracer)})" if tracer else ""
    if why is None:
        logger.info("%s: traced on example inputs%s", name, note)
    else:
        logger.warning("%s: %s; traced it with example inputs instead, so control flow "
                       "is fixed to the path those inputs took%s", name, why, note)
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
