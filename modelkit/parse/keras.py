"""Keras model configs as stored: a JSON document (`config.json` in .keras zips, tokenizer configs) and
the JSON of a legacy .h5 file's `model_config` attribute, found in the HDF5 bytes without h5py.

HDF5 stores a string attribute's bytes contiguously, so a config is found by searching for where a
Keras config starts (`{"class_name"` / `{"module"`), bounded by the NUL that ends the attribute, and
decoded with json. Sizes and the number of candidates are capped before anything is decoded.
`model_config` unwraps the ways a config is stored; `marshalled_code` tells a string that holds a
marshalled Python code object (what Keras's `func_dump` writes for a Lambda's function).
Standard library only.
"""
from __future__ import annotations

import binascii
import json
import re

from modelkit.errors import ParseError

MAX_JSON = 64 << 20
MAX_CANDIDATES = 10_000
CONFIG_STARTS = (b'{"class_name"', b'{"module"')
_BASE64 = re.compile(r"[A-Za-z0-9+/=\s]+")
# marshal's TYPE_CODE ('c'), with and without FLAG_REF (0x80): the first byte of marshal.dumps(code)
_CODE_TYPES = (0x63, 0xE3)


def load_json(buf, start: int = 0, end: int | None = None):
    """The JSON document in buf[start:end].

    Raises:
        ParseError: larger than MAX_JSON, not UTF-8, or not JSON.
    """
    end = len(buf) if end is None else end
    if end - start > MAX_JSON:
        raise ParseError(f"JSON larger than {MAX_JSON} bytes was not read")
    try:
        return json.loads(bytes(buf[start:end]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ParseError(f"not valid JSON ({e})") from None


def configs_in(buf, start: int = 0, end: int | None = None):
    """Yield (offset, document) for each JSON object in buf[start:end] that starts like a Keras config.

    Candidates that do not decode are skipped; at most MAX_CANDIDATES are tried.
    """
    end = len(buf) if end is None else end
    pos, candidates = start, 0
    while candidates < MAX_CANDIDATES:
        hits = [h for h in (buf.find(s, pos, end) for s in CONFIG_STARTS) if h >= 0]
        if not hits:
            return
        at = min(hits)
        candidates += 1
        stop = buf.find(b"\x00", at, min(end, at + MAX_JSON))
        stop = stop if stop >= 0 else min(end, at + MAX_JSON)
        try:
            doc, used = json.JSONDecoder().raw_decode(bytes(buf[at:stop]).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            pos = at + 1
            continue
        yield at, doc
        pos = at + max(used, 1)


def model_config(doc):
    """The Keras model config a decoded JSON document holds, however it is wrapped, or None.

    Accepted: a bare config or a `model.to_json()` document (`{"class_name", "config", ...}`), and the
    `{"model_config": {...}, "training_config": ...}` wrapper (a TF.js modelTopology, a legacy .h5's
    attributes).
    """
    if not isinstance(doc, dict):
        return None
    inner = doc.get("model_config")
    if isinstance(inner, dict) and isinstance(inner.get("class_name"), str):
        return inner
    if isinstance(doc.get("class_name"), str):
        return doc
    return None


def marshalled_code(text: str) -> bool:
    """`text` is a marshalled Python code object as Keras's func_dump stores it: base64 (line breaks
    allowed) whose first byte is marshal's code type, followed by a small argument count."""
    if len(text) < 12 or text[:2] not in ("4w", "Yw") or not _BASE64.fullmatch(text[:4096]):
        return False
    head = "".join(text[:64].split())[:12]
    try:
        raw = binascii.a2b_base64(head)
    except binascii.Error:
        return False
    return len(raw) >= 5 and raw[0] in _CODE_TYPES and int.from_bytes(raw[1:5], "little") < 256


# ---------------------------------------------------------------------------------------------
# .keras archives (Keras 3's model.save): a zip of config.json, metadata.json and model.weights.h5
# (keras/src/saving/saving_lib.py)

ARCHIVE_CONFIG = "config.json"
ARCHIVE_METADATA = "metadata.json"
ARCHIVE_WEIGHTS = "model.weights.h5"
ARCHIVE_WEIGHTS_NPZ = "model.weights.npz"      # what Keras writes for backends whose weights h5py cannot hold


def is_archive(names) -> bool:
    """Member names of a .keras archive: config.json beside metadata.json or the weights Keras loads."""
    names = set(names)
    return ARCHIVE_CONFIG in names and bool(names & {ARCHIVE_METADATA, ARCHIVE_WEIGHTS, ARCHIVE_WEIGHTS_NPZ})


class Archive:
    """What a .keras archive holds, read from its central directory and its two JSON members: the Keras model
    config (`config`), the metadata document (`metadata`, {} when absent) and the weights member
    (`weights`, a zipdir entry, with `weights_start`: where its stored bytes start in the archive)."""

    __slots__ = ("config", "metadata", "weights", "weights_start")

    def __init__(self, config: dict, metadata: dict, weights, weights_start: int) -> None:
        self.config, self.metadata, self.weights, self.weights_start = config, metadata, weights, weights_start


def read_archive(buf) -> Archive:
    """The parts of a .keras archive in `buf` (bytes or an mmap).

    Raises:
        ParseError: not a zip, a member name that escapes or appears twice, no config.json or model.weights.h5,
            a JSON member over MAX_JSON, or one that is not a Keras model config / a JSON object.
    """
    from modelkit.parse import zipdir
    from modelkit.parse.paths import member_problem

    entries: dict = {}
    for entry in zipdir.read_directory(buf):
        problem = member_problem(entry.filename)
        if problem:
            raise ParseError(f"member {entry.filename[:80]!r} {problem}")
        if entry.filename in entries:
            raise ParseError(f"member {entry.filename[:80]!r} appears twice (readers pick different copies)")
        entries[entry.filename] = entry
    if ARCHIVE_CONFIG not in entries:
        raise ParseError(f"a zip without {ARCHIVE_CONFIG}: not a .keras archive")
    if ARCHIVE_WEIGHTS not in entries:
        also = f" (its weights are in {ARCHIVE_WEIGHTS_NPZ}, which modelkit does not read)" \
            if ARCHIVE_WEIGHTS_NPZ in entries else ""
        raise ParseError(f"the archive has no {ARCHIVE_WEIGHTS}{also}")

    def document(name: str) -> object:
        entry = entries[name]
        if entry.file_size > MAX_JSON:
            raise ParseError(f"{name} is {entry.file_size} bytes; JSON larger than {MAX_JSON} bytes is not read")
        data = bytearray(entry.file_size)
        zipdir.read_into(buf, entry, data)
        return load_json(data)

    config = model_config(document(ARCHIVE_CONFIG))
    if config is None:
        raise ParseError(f"{ARCHIVE_CONFIG} is not a Keras model config (no class_name)")
    metadata = document(ARCHIVE_METADATA) if ARCHIVE_METADATA in entries else {}
    if not isinstance(metadata, dict):
        raise ParseError(f"{ARCHIVE_METADATA} is not a JSON object")
    weights = entries[ARCHIVE_WEIGHTS]
    zipdir.read_start(buf, weights, 0)          # stored or deflated, not encrypted, its local header agrees
    return Archive(config, metadata, weights, zipdir.member_data(buf, weights))


_SHOWN = ("units", "filters", "kernel_size", "strides", "padding", "activation", "pool_size", "rate", "axis",
          "batch_input_shape", "batch_shape", "target_shape", "input_dim", "output_dim")


def describe_layers(config) -> list[dict[str, str]]:
    """A Keras model config's layers, for `modelkit inspect`: name, class and the arguments that shape it."""
    items = config.get("config", {}).get("layers", []) if isinstance(config, dict) and isinstance(
        config.get("config"), dict) else []
    shown = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        args = item.get("config") if isinstance(item.get("config"), dict) else {}
        shown.append({"name": str(args.get("name", item.get("name", "")))[:80], "class": str(item.get("class_name"))[:80],
                      "config": ", ".join(f"{k}={json.dumps(args[k])}" for k in _SHOWN if k in args)[:160]})
    return shown
