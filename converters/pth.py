"""pth: `torch.save` checkpoints (.pt, .pth, .bin, .ckpt): a pickle plus raw tensor storages.

Spec: the reader and writer in torch/serialization.py (`torch.save`, `torch.load`); safety:
https://pytorch.org/docs/stable/notes/serialization.html#weights-only
Layout (zip, torch >= 1.6): a zip archive whose members all sit under one folder `<archive>/`:
    data.pkl     the pickled object; each tensor is `_rebuild_tensor_v2(<persistent id>, offset,
                 size, stride, ...)` and the persistent id is ('storage', type, key, location, numel)
    data/<key>   the storage's raw bytes, stored uncompressed at 64-byte aligned offsets
    byteorder | version | .format_version | .storage_alignment | .data/serialization_id
Layout (legacy, `_use_new_zipfile_serialization=False`): one stream of protocol-2 pickles:
    magic number (LONG1 0x1950a86a20f9469cfc6c) | protocol version | sys info | the object |
    storage keys | for each storage: 8-byte element count + raw bytes

What modelkit writes (docs/formats/pth.md): exactly a state_dict, an OrderedDict of tensors, so
`model.load_state_dict(torch.load(path, weights_only=True))` works. The ArchSpec and the str->str
metadata ride in the OrderedDict's `_metadata` attribute (where `Module.state_dict()` keeps
per-module versions) under the key `__modelkit__`; `load_state_dict` only looks that dict up by
module prefix, and no module prefix is `__modelkit__` in practice.

Quantized weights (QuantizedTensor) are stored as their parts in compressed-tensors' layout
(`N_packed`, `N_scale`, `N_zero_point`, `N_shape`; `N` int8 for int8-dynamic), described by the "modelkit.quantized" record
in that same metadata entry: modelkit/storage/quantized_layout.py, shared with safetensors. Reading
puts them back together (the parts are plain tensors, read like any other).

Reading never unpickles: a weights-only checkpoint (what `torch.load(weights_only=True)` accepts)
is read by modelkit.parse.torch_format, which interprets the pickle symbolically, checks every
storage record and view against the file, and gives each tensor as a numpy view of the mapped file
(strided views copied, byte-for-byte what torch.load gives); no torch import on that path. Only a
whole-module pickle (classes beyond torch's weights-only allowlist) goes to `torch.load`, and only
with `trust`.
"""
from __future__ import annotations

import json
import logging
import re
import sys
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelkit.checkpoint import ALIASES_KEY, ArchSpec, Checkpoint
from modelkit.errors import FormatError, UnsupportedConversionError
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.metadata import PTH_LAYOUT, PTH_METADATA_ENTRY, PTH_SOURCE_KEY
from modelkit.parse import torch_format
from modelkit.parse.detect import TORCH_LEGACY_HEAD
from modelkit.parse.detect import pth as detect  # noqa: F401  (the converter's detect)
from modelkit.storage import quantized_layout
from modelkit.storage import zip_records as _zip_records
from modelkit.storage.dtypes import DTYPES
from modelkit.storage.mapped import FileSpan
from modelkit.storage.tensors import LazyTensor
from modelkit.storage.write_behind import write_all

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# torch.save's legacy stream starts with the pickled magic number (torch/serialization.py MAGIC_NUMBER).
_MODELKIT_KEY = PTH_METADATA_ENTRY      # entry of state_dict._metadata holding our metadata
_LAYOUT = PTH_LAYOUT
SOURCE_KEY = PTH_SOURCE_KEY             # metadata: which entry or object the state_dict came from
_FILL_MIN = 64 << 20                    # from this many copyable bytes on, storages are copied file to file
_WELL_KNOWN = ("state_dict", "model_state_dict", "model", "module", "net", "network", "model_state", "weights")
_WRAPPER_PREFIXES = ("module", "model", "_orig_mod")   # DDP/DeepSpeed, Lightning, torch.compile
# The modules of torch 2.13's weights_only allowlist: a plain weights pickle names globals from
# these only, and modelkit's own reader reads it (what it does not rebuild, such as a sparse or
# quantized tensor, stays an opaque placeholder). Any other global is an object to rebuild (a whole
# module, argparse.Namespace, numpy arrays, ...): that needs torch.load and trust.
_DATA_MODULES = frozenset({
    "_codecs", "builtins", "collections", "torch", "torch._tensor", "torch._utils", "torch.cuda",
    "torch.cuda.sparse", "torch.nn.parameter", "torch.serialization", "torch.sparse", "torch.storage",
})


def _gate(path: Path, options: ReadOptions) -> str:
    """The scanner's gate: scan `path` before anything unpickles it; returns what it checked.

    Dangerous content is refused with UnsafeFileError(path, report) even with trust; content that
    needs trust (a whole-module pickle, unknown classes) is refused without it. modelkit's own
    parser (parse.torch_format) then reads a weights-only file, and torch.load only a trusted
    whole-object pickle: the scan is defence in depth, not a replacement.
    """
    from modelkit.scan import gate

    report = gate(path, trust=options.trust)
    return f"scanned, {len(report.findings)} finding(s), none dangerous"


def read(path: Path, options: ReadOptions = ReadOptions()) -> Checkpoint:
    """Read the state_dict of a torch.save file (zip or legacy), lazily: tensors are views of the mapped file.

    Nested checkpoints ({"model": ..., "optimizer": ...}, Lightning's {"state_dict": ...}) give
    the state_dict under a well-known key when it is the only one; otherwise `options.key` picks
    an entry ("model", "state_dict.model" for nested dicts, "module" to strip a `module.` prefix).

    A weights-only checkpoint is read by modelkit.parse.torch_format without torch; a pickle of
    other classes (a whole module) needs `options.trust` and is loaded with torch.load.
    """
    is_zip = _layout(path)            # the zip directory or the first bytes: nothing unpickled yet
    if is_zip and not detect(path):
        raise FormatError(path, "a zip archive without data.pkl, or a TorchScript archive "
                                "(read those with --from torchscript)")
    gate = _gate(path, options)
    parsed = _parse(path)
    classes = _classes(parsed)
    if classes:
        return _read_with_torch(path, is_zip, parsed, classes, options, gate)
    state, where = _choose_state_dict(path, parsed.value, options.key)
    metadata, arch = _stored_metadata(path, state)
    if where:
        metadata[SOURCE_KEY] = where
    records = _check_tensors(path, state, options.key)
    _hint_prefix(path, records)
    return quantized_layout.group(path, _checkpoint(path, parsed, records, arch, metadata))


def _parse(path: Path) -> torch_format.TorchFile:
    """The checkpoint's structure, every storage and view checked against the file (ParseError names it)."""
    try:
        return torch_format.read(path)
    except OSError as e:
        raise FormatError(path, f"cannot read the file ({e})") from e


def _classes(parsed: torch_format.TorchFile) -> list[str]:
    """Globals outside the modules a plain weights pickle uses: objects to rebuild."""
    return [g for g in parsed.globals if g.rpartition(".")[0] not in _DATA_MODULES]


def _checkpoint(path: Path, parsed: torch_format.TorchFile, records: dict[str, torch_format.TensorRecord],
                arch: ArchSpec | None, metadata: dict[str, str]) -> Checkpoint:
    """LazyTensors over the parsed records; tied tensors (same storage, offset, size, stride and dtype)
    are recorded as aliases of their first name, as Checkpoint.from_state_dict records them."""
    tensors: dict[str, LazyTensor] = {}
    first: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    for name, record in records.items():
        if record.numel:
            target = first.setdefault(record.identity, name)
            if target != name:
                aliases[name] = target
        span = parsed.span(record)
        tensors[name] = LazyTensor(DTYPES[record.dtype], record.size, partial(parsed.array, record), name,
                                   FileSpan(path, *span) if span is not None else None)
    if aliases:
        metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    return Checkpoint(tensors, metadata, arch)


def _read_with_torch(path: Path, is_zip: bool, parsed: torch_format.TorchFile, classes: list[str],
                     options: ReadOptions, gate: str) -> Checkpoint:
    """A pickle of classes beyond tensors (a whole module): torch.load, only with trust."""
    import torch

    obj = _load(path, is_zip, parsed, classes, options, gate)
    notes: dict[str, str] = {}
    if isinstance(obj, torch.nn.Module):
        notes[SOURCE_KEY] = f"whole-module pickle of {type(obj).__module__}.{type(obj).__qualname__}"
    state, where = _choose_state_dict(path, obj, options.key)
    if where:
        notes[SOURCE_KEY] = where
    metadata, arch = _stored_metadata(path, state)
    if arch is None and isinstance(obj, torch.nn.Module) and getattr(type(obj), "arch", None):
        from modelkit.models import MODELS, arch_spec

        arch = arch_spec(obj) if type(obj).arch in MODELS else None
    tensors = _check_tensors(path, state, options.key)
    _hint_prefix(path, tensors)
    ckpt = Checkpoint.from_state_dict(tensors, arch=arch, metadata={**metadata, **notes})
    if is_zip:
        for name, span in _file_spans(path, tensors).items():
            ckpt.tensors[name] = replace(ckpt.tensors[name], span=span)
    return quantized_layout.group(path, ckpt)


def _file_spans(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, FileSpan]:
    """Where each tensor's bytes lie in the zip file, for tensors torch.load(mmap=True) left as views of it.

    torch maps the whole file and gives each storage the slice at its record (`<archive>/data/<key>`,
    stored uncompressed). The mapping's base address is the one that puts every storage exactly at
    the start of a data record; if no such base exists (byte-swapped or copied tensors), no spans.
    """
    try:
        starts = {r.data_offset: r.nbytes for r in _zip_records.records(path).values() if "/data/" in f"/{r.name}"}
    except (OSError, ValueError, FormatError):
        return {}
    if not starts or sys.byteorder != "little":
        return {}
    stored = {name: t for name, t in tensors.items() if t.device.type == "cpu" and t.untyped_storage().nbytes()}
    pointers = {t.untyped_storage().data_ptr() for t in stored.values()}
    base = min(pointers, default=0) - min(starts)
    if not pointers or any(p - base not in starts for p in pointers):
        return {}
    spans = {}
    for name, t in stored.items():
        start = t.untyped_storage().data_ptr() - base
        offset, nbytes = t.storage_offset() * t.element_size(), t.numel() * t.element_size()
        if t.is_contiguous() and offset + nbytes <= starts[start]:
            spans[name] = FileSpan(path, start + offset, nbytes)
    return spans


def _layout(path: Path) -> bool:
    """True for the zip layout, False for the legacy stream; FormatError for anything else."""
    try:
        with path.open("rb") as f:
            head = f.read(len(TORCH_LEGACY_HEAD))
    except OSError as e:
        raise FormatError(path, f"cannot read the file ({e})") from e
    if head == TORCH_LEGACY_HEAD:
        return False
    if head.startswith(b"PK\x03\x04"):
        return True
    raise FormatError(path, "not a torch.save checkpoint (neither a zip archive nor the legacy pickle stream)")


def _load(path: Path, is_zip: bool, parsed: torch_format.TorchFile, classes: list[str], options: ReadOptions,
          gate: str) -> Any:
    """torch.load with weights_only=False for a pickle of other classes; refused without options.trust."""
    import torch

    if not options.trust:
        module_like = {"_modules", "_parameters"} <= parsed.build_keys
        what = "a whole module" if module_like else "Python objects beyond tensors"
        raise UnsupportedConversionError(
            str(path), "a checkpoint without --trust",
            f"this file pickles {what} (class {classes[0]}); loading it runs code: pass --trust "
            "(API: trust=True) if you trust its source, or ask for a state_dict",
        )
    logger.warning("%s: loading a pickle of class %s with weights_only=False because trust was given: "
                   "this runs code from the file; scanner gate: %s", path, classes[0], gate)
    try:
        # mmap only works for the zip layout; there the tensors stay views into the mapped file.
        return torch.load(path, map_location="cpu", weights_only=False, mmap=is_zip)
    except Exception as e:  # torch.load raises a wide, undocumented set of types on malformed input
        hint = f" (with trust: the module defining {classes[0]} must be importable)"
        raise FormatError(path, f"torch.load failed: {_short(e)}{hint}") from e


def _short(error: Exception) -> str:
    text = str(error)
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if refused:
        return f"weights-only loading refuses the global {refused.group(1)} ({type(error).__name__})"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0][:300] if lines else 'no message'}"


def _torch() -> Any:
    """torch when something already imported it (a whole-module read), else None: never imported here."""
    return sys.modules.get("torch")


def _is_tensor(value: Any) -> bool:
    if isinstance(value, torch_format.TensorRecord):
        return True
    torch = _torch()
    return torch is not None and isinstance(value, torch.Tensor)


def _is_module(value: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(value, torch.nn.Module)


def _kind(value: Any) -> str:
    """What an entry is, for messages: 'Tensor', 'int', or what an opaque placeholder stands for."""
    if _is_tensor(value):
        return "Tensor"
    if isinstance(value, torch_format.Opaque):
        return value.what
    return type(value).__name__


def _choose_state_dict(path: Path, obj: Any, key: str | None) -> tuple[Mapping[Any, Any], str]:
    """The mapping holding the tensors, and where it came from ("" for the top level)."""
    if _is_module(obj):
        obj = obj.state_dict()
    if not isinstance(obj, Mapping):
        raise FormatError(path, f"holds a {_kind(obj)}, not a state_dict (a dict of tensors)")
    if key is not None:
        return _resolve_key(path, obj, key), key
    if any(_is_tensor(v) for v in obj.values()):
        return obj, ""
    candidates = _candidates(obj)
    if len(candidates) == 1 and candidates[0][0].rpartition(".")[2].lower() in _WELL_KNOWN:
        where, state = candidates[0]
        logger.info("%s: using the state_dict under %r (other entries: %s)", path, where,
                    ", ".join(str(k) for k in obj if k != where) or "none")
        return state, where
    if not candidates:
        raise FormatError(path, f"holds no tensors; top-level entries: {_listing(obj)}")
    raise FormatError(path, "is a nested checkpoint; pick the state_dict with --key NAME (API: key=...); "
                            f"candidates: {', '.join(f'{p} ({_count(m)} tensors)' for p, m in candidates)}")


def _candidates(obj: Mapping[Any, Any], prefix: str = "", depth: int = 0) -> list[tuple[str, Mapping[Any, Any]]]:
    """Nested str-keyed mappings that hold tensors directly (optimizer states are int-keyed)."""
    found = []
    for k, v in obj.items():
        if _is_module(v):
            v = v.state_dict()
        if not isinstance(k, str) or not isinstance(v, Mapping) or not all(isinstance(i, str) for i in v):
            continue
        where = f"{prefix}{k}"
        if any(_is_tensor(t) for t in v.values()):
            found.append((where, v))
        elif depth < 3:
            found += _candidates(v, f"{where}.", depth + 1)
    return found


def _resolve_key(path: Path, obj: Mapping[Any, Any], key: str) -> Mapping[Any, Any]:
    """Follow `key` through nested dicts; a remainder that is a name prefix selects and strips it."""
    node: Any = obj
    rest = key
    while rest:
        if not isinstance(node, Mapping):
            break
        if rest in node:
            node, rest = node[rest], ""
            break
        head = next((k for k in node if isinstance(k, str) and rest.startswith(f"{k}.")), None)
        if head is not None and (isinstance(node[head], Mapping) or _is_module(node[head])):
            node, rest = node[head], rest[len(head) + 1:]
            node = node.state_dict() if _is_module(node) else node
            continue
        prefix = rest if rest.endswith(".") else f"{rest}."
        picked = {k[len(prefix):]: v for k, v in node.items() if isinstance(k, str) and k.startswith(prefix)}
        if picked:
            return picked
        break
    if _is_module(node):
        node = node.state_dict()
    if rest or not isinstance(node, Mapping):
        candidates = ", ".join(p for p, _ in _candidates(obj)) or "none"
        raise FormatError(path, f"--key {key!r} names no state_dict here; top-level entries: {_listing(obj)}; "
                                f"nested state_dicts: {candidates}")
    return node


def _listing(obj: Mapping[Any, Any]) -> str:
    shown = [f"{k} ({_kind(v)})" for k, v in list(obj.items())[:12]]
    return ", ".join(shown) + (", ..." if len(obj) > 12 else "") if shown else "none"


def _count(obj: Mapping[Any, Any]) -> int:
    return sum(_is_tensor(v) for v in obj.values())


def _check_tensors(path: Path, state: Mapping[Any, Any], key: str | None) -> dict[str, Any]:
    """Every entry must be a dense tensor with a str name, of a dtype modelkit reads."""
    stored_otherwise = [(k, v) for k, v in state.items()
                        if isinstance(v, torch_format.Opaque) and v.what.startswith("torch._utils._rebuild_")]
    if stored_otherwise:
        name, value = stored_otherwise[0]
        raise FormatError(path, f"tensor {name!r} is stored with {value.what} (a quantized, sparse or other "
                                "non-dense tensor); only dense tensors are supported")
    bad = [(k, v) for k, v in state.items() if not isinstance(k, str) or not _is_tensor(v)]
    if bad:
        shown = ", ".join(f"{k!r} ({_kind(v)})" for k, v in bad[:3])
        nested = [p for p, _ in _candidates(state)]
        hint = f"; pick one of its nested state_dicts with --key: {', '.join(nested)}" if nested else (
            "" if key else "; if the tensors sit under one entry, pass --key NAME")
        count = f"{len(bad)} entries that are not named tensors" if len(bad) > 1 else "an entry that is not a named tensor"
        raise FormatError(path, f"the state_dict{f' under {key!r}' if key else ''} has {count}: {shown}{hint}")
    for name, t in state.items():
        if isinstance(t, torch_format.TensorRecord):
            if t.dtype not in DTYPES:
                raise FormatError(path, f"tensor {name!r} is {t.dtype}, which modelkit does not read "
                                        f"(it reads {', '.join(DTYPES)})")
            continue
        import torch

        if t.layout != torch.strided or t.is_quantized or t.device.type != "cpu":
            raise FormatError(path, f"tensor {name!r} is a {t.layout} {t.dtype} tensor on {t.device}; "
                                    "only dense CPU tensors are supported")
    if not state:
        raise FormatError(path, "the state_dict is empty")
    return dict(state)


def _hint_prefix(path: Path, tensors: Mapping[str, Any]) -> None:
    first = {name.partition(".")[0] for name in tensors}
    if len(first) == 1 and next(iter(first)) in _WRAPPER_PREFIXES and all("." in n for n in tensors):
        prefix = next(iter(first))
        logger.info("%s: every tensor name starts with %r (a training wrapper's prefix); pass --key %s "
                    "to strip it", path, f"{prefix}.", prefix)


def _stored_metadata(path: Path, state: Mapping[Any, Any]) -> tuple[dict[str, str], ArchSpec | None]:
    """modelkit's metadata and ArchSpec from state_dict._metadata['__modelkit__'], if present."""
    versions = getattr(state, "_metadata", None)
    entry = versions.get(_MODELKIT_KEY) if isinstance(versions, Mapping) else None
    if entry is None:
        return {}, None
    metadata = entry.get("metadata") if isinstance(entry, Mapping) else None
    arch_json = entry.get("arch") if isinstance(entry, Mapping) else None
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise FormatError(path, f"the {_MODELKIT_KEY} metadata entry must map str to str")
    if arch_json is not None and not isinstance(arch_json, str):
        raise FormatError(path, f"the {_MODELKIT_KEY} arch entry must be a JSON string")
    arch = ArchSpec.from_json(arch_json, source=path) if arch_json is not None else None
    return dict(metadata), arch


def write(ckpt: Checkpoint, path: Path, options: WriteOptions = WriteOptions()) -> None:
    """Write a plain state_dict with torch.save (zip layout); metadata goes in `_metadata`.

    torch.save pickles every tensor before it writes any storage, so this holds the whole model
    in memory (tensors that are mmap views, as from another .pt file, stay in the page cache).
    When tensors come with a place in their source file (LazyTensor.span) and there are at least
    _FILL_MIN bytes of them, torch.save writes the archive without storage bytes
    (`skip_data`), and they are copied into their records file to file, their CRC-32s computed
    meanwhile on another thread: the same archive, without torch's single-threaded CRC pass and
    user-space copy (safetensors -> pt of 980 MiB: 1.36-1.41x -> 1.1-1.3x the time of a plain copy).
    """
    import torch

    ckpt, _ = quantized_layout.flatten(ckpt, target="pth")   # quantized weights as their parts + a record
    aliases = _aliases(ckpt)
    state: OrderedDict[str, torch.Tensor] = OrderedDict()
    spans: dict[str, FileSpan] = {}
    for name, entry in ckpt.tensors.items():
        target = aliases.get(name)
        if target in state:                         # tied: the same tensor object, saved once
            state[name] = state[target]
            continue
        tensor = entry.load().detach()
        if tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()                 # a view of a larger buffer: save only its own bytes
        state[name] = tensor
        if getattr(entry, "span", None) is not None and entry.span.nbytes == tensor.nbytes:
            spans[name] = entry.span
    state._metadata = OrderedDict({_MODELKIT_KEY: {  # type: ignore[attr-defined]
        "format": _LAYOUT,
        "arch": ckpt.arch.to_json() if ckpt.arch is not None else None,
        "metadata": dict(ckpt.metadata),
    }})
    fill = sum(spans[n].nbytes for n in spans) >= _FILL_MIN and hasattr(torch.serialization, "skip_data")
    # A file object, not a path: torch names the zip's folder after a path's stem, which here is
    # the temporary name; with a file object it is always "archive".
    with path.open("wb") as f:
        if not fill:
            torch.save(state, f)
            return
        with torch.serialization.skip_data():
            torch.save(state, f)
    try:
        _fill_storages(path, state, spans)
    except FormatError as e:     # a torch whose archives are laid out otherwise: let torch.save write it all
        logger.debug("filling the records of %s failed (%s); writing it with plain torch.save", path, e)
        with path.open("wb") as f:
            torch.save(state, f)


def _fill_storages(path: Path, state: Mapping[str, torch.Tensor], sources: dict[str, FileSpan]) -> None:
    """Copy each storage into the record torch.save reserved for it, and set the records' CRC-32s."""
    import zlib
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from modelkit.storage.mapped import copy_span

    skeleton = torch.load(path, map_location="cpu", mmap=True, weights_only=True)   # our own file, just written
    places = _file_spans(path, {n: t for n, t in skeleton.items() if isinstance(t, torch.Tensor)})
    del skeleton
    layout = _zip_records.records(path)
    todo: dict[int, str] = {}
    for name, place in places.items():
        if name in state and place.offset in layout:
            todo.setdefault(place.offset, name)        # tied tensors share one record
    storages = {t.untyped_storage().data_ptr() for t in state.values() if t.untyped_storage().nbytes()}
    if len(todo) != len(storages) or any(layout[offset].descriptor_crc is None for offset in todo):
        raise FormatError(path, "torch.save's archive does not have one record with a data descriptor per storage; cannot fill it")

    def crc(name: str) -> int:                          # zlib releases the GIL: this overlaps the copies
        return zlib.crc32(_bytes(state[name]))

    with ThreadPoolExecutor(1) as pool, path.open("r+b") as out:
        crcs = {offset: pool.submit(crc, name) for offset, name in todo.items()}
        for offset, name in todo.items():
            if name in sources:
                copy_span(sources[name], out, at=offset)
            else:
                out.seek(offset)
                write_all(out, _bytes(state[name]))
        out.flush()
        values = {layout[offset]: future.result() for offset, future in crcs.items()}
    _zip_records.patch_crcs(path, values)


def _bytes(tensor: torch.Tensor) -> memoryview:
    import torch

    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def _aliases(ckpt: Checkpoint) -> dict[str, str]:
    try:
        aliases = json.loads(ckpt.metadata.get(ALIASES_KEY, "{}"))
    except json.JSONDecodeError:
        return {}
    return {a: t for a, t in aliases.items() if isinstance(t, str)} if isinstance(aliases, dict) else {}
