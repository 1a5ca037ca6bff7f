"""Header integrity for weight containers that run no code: safetensors and GGUF (plus GGUF chat templates).

These formats cannot run code by themselves, but a header that lies (lengths past the end of the
file, overlapping tensors, counts that make a reader allocate terabytes) crashes or misleads the
readers that trust it, and a GGUF chat template is a Jinja program some runtimes render. Every
length and count is checked against the file size before anything is read; tensor data never is.
Standard library only.
"""
from __future__ import annotations

import json
import re
import struct
from typing import TYPE_CHECKING

from modelkit.scan.model import Severity

if TYPE_CHECKING:
    from modelkit.scan.containers import Context

SAFETENSORS_MAX_HEADER = 100_000_000     # the safetensors library refuses larger headers
# dtype -> bits per element (safetensors/src/tensor.rs Dtype::bitsize)
SAFETENSORS_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
                    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64,
                    "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def _fail(ctx: Context, label: str, rule: str, detail: str, offset: int | None = None,
          severity: Severity = Severity.DANGEROUS) -> None:
    ctx.sink(label).add(severity, rule, detail, offset=offset)


def scan_safetensors(buf, start: int, end: int, ctx: Context, label: str) -> None:
    """8-byte little-endian header length, JSON header, then the tensor bytes the offsets describe."""
    size = end - start
    (n,) = struct.unpack_from("<Q", buf, start)
    if n > SAFETENSORS_MAX_HEADER or 8 + n > size:
        _fail(ctx, label, "safetensors.header.length", f"header length {n} does not fit a {size}-byte file", 0)
        return
    outermost: list[list[tuple[str, object]]] = [[]]

    def keep(items):      # the last object closed is the outermost one
        outermost[0] = items
        return dict(items)
    try:
        header = json.loads(bytes(buf[start + 8:start + 8 + n]).decode("utf-8"), object_pairs_hook=keep)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        _fail(ctx, label, "safetensors.header.json", f"header is not valid UTF-8 JSON ({e})", 8)
        return
    if not isinstance(header, dict):
        _fail(ctx, label, "safetensors.header.json", "header is not a JSON object", 8)
        return
    if len(header) != len(outermost[0]):
        _fail(ctx, label, "safetensors.header.duplicate", "header names a key twice; readers disagree on which wins", 8)
    data_len = size - 8 - n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                _fail(ctx, label, "safetensors.header.metadata", "__metadata__ must map strings to strings", 8,
                      Severity.SUSPICIOUS)
            continue
        problem = _tensor_problem(info, data_len)
        if problem:
            _fail(ctx, label, "safetensors.header.tensor", f"tensor {name!r}: {problem}", 8)
            return
        spans.append((info["data_offsets"][0], info["data_offsets"][1], name))
    spans.sort()
    cursor = 0
    for begin, stop, name in spans:
        if begin < cursor:
            _fail(ctx, label, "safetensors.header.overlap", f"tensor {name!r} overlaps the tensor before it", 8)
            return
        if begin > cursor:
            _fail(ctx, label, "safetensors.header.gap", f"{begin - cursor} unused bytes before tensor {name!r}",
                  8, Severity.SUSPICIOUS)
        cursor = stop
    ctx.examined.append(f"{label}: safetensors header, {len(spans)} tensors")
    if cursor < data_len:
        from modelkit.scan.containers import trailing
        trailing(buf, start + 8 + n + cursor, end, ctx, label, base=start)


def _tensor_problem(info: object, data_len: int) -> str | None:
    if not isinstance(info, dict):
        return "entry is not an object"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in SAFETENSORS_BITS:
        return f"unknown dtype {dtype!r}"
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        return f"shape {shape!r} is not a list of non-negative integers"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        return f"data_offsets {offsets!r} is not [begin, end]"
    begin, stop = offsets
    if not 0 <= begin <= stop <= data_len:
        return f"data_offsets {offsets} fall outside the {data_len} data bytes"
    bits = SAFETENSORS_BITS[dtype]
    for d in shape:
        bits *= d
    if bits % 8 or bits // 8 != stop - begin:
        return f"{dtype} x {shape} needs {bits / 8:g} bytes, the offsets span {stop - begin}"
    return None


# ---------------------------------------------------------------------------------------------
# GGUF: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
# header: magic 'GGUF' | u32 version | u64 tensor_count | u64 kv_count  (v1: u32 counts)
# kv: string key | u32 type | value;   string: u64 length | bytes;   array: u32 type | u64 count | items
# tensor info: string name | u32 n_dims | u64 dims[n_dims] | u32 ggml type | u64 offset

_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# ggml type -> (block size, bytes per block): gguf-py's GGML_QUANT_SIZES
GGML_TYPES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
              10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
              16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110),
              22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
              29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18)}
MAX_GGUF_STRING = 64 << 20
MAX_GGUF_DIMS = 4

# Jinja template injection (server-side template injection reaching Python objects): dunder attributes,
# and the globals Jinja exposes whose __init__.__globals__ leads to os (cycler, joiner, namespace, lipsum).
_TEMPLATE_PATTERNS = (
    (re.compile(r"__[A-Za-z]\w*__"), "reaches a Python dunder attribute"),
    (re.compile(r"\b(cycler|joiner|namespace|lipsum|range|dict|self|config|request|url_for)\s*"
                r"(\.\s*_|\[\s*['\"]_|\|\s*attr)"), "walks from a Jinja global into Python internals"),
    (re.compile(r"\|\s*attr\s*\("), "uses the attr filter, which builds attribute names at render time"),
    (re.compile(r"\\x5f|\\u005f|\\137|%c|\|\s*format\s*\(\s*['\"]?%c"), "spells underscores with escapes"),
    (re.compile(r"\b(os|subprocess|builtins|importlib|sys)\s*\.\s*(system|popen|import_module|modules|run)"),
     "names an OS or import function"),
    (re.compile(r"\b(mro|subclasses|globals|builtins|import)\b\s*\("), "calls interpreter introspection"),
)


class _GGUFError(Exception):
    pass


class _Reader:
    def __init__(self, buf, pos: int, end: int) -> None:
        self.buf, self.pos, self.end = buf, pos, end

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > self.end:
            raise _GGUFError(f"header runs past the end of the file at byte {self.pos}")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self, count_fmt: str) -> str:
        n = self.take(count_fmt)
        if n > MAX_GGUF_STRING or self.pos + n > self.end:
            raise _GGUFError(f"a string claims {n} bytes, {self.end - self.pos} remain")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _GGUFError(f"a string is not UTF-8 ({e})") from e

    def value(self, vtype: int, count_fmt: str, depth: int = 0):
        if vtype in _GGUF_SCALAR:
            return self.take(_GGUF_SCALAR[vtype])
        if vtype == _GGUF_STRING:
            return self.string(count_fmt)
        if vtype == _GGUF_ARRAY and depth < 2:
            self.skip_array(count_fmt, depth)
            return None
        raise _GGUFError(f"unknown value type {vtype}")

    def skip_array(self, count_fmt: str, depth: int) -> None:
        """Validate an array's extent without building it (token lists hold 100k+ strings)."""
        etype, count = self.take("<I"), self.take(count_fmt)
        if etype in _GGUF_SCALAR:
            size = struct.calcsize(_GGUF_SCALAR[etype])
            if count * size > self.end - self.pos:
                raise _GGUFError(f"an array claims {count} items, which cannot fit the {self.end - self.pos} bytes left")
            self.pos += count * size
        elif etype == _GGUF_STRING:
            if count * 8 > self.end - self.pos:
                raise _GGUFError(f"an array claims {count} strings, which cannot fit the {self.end - self.pos} bytes left")
            for _ in range(count):
                n = self.take(count_fmt)
                if n > self.end - self.pos:
                    raise _GGUFError(f"a string claims {n} bytes, {self.end - self.pos} remain")
                self.pos += n
        elif etype == _GGUF_ARRAY and depth < 1:
            if count * 12 > self.end - self.pos:
                raise _GGUFError(f"an array claims {count} arrays, which cannot fit the file")
            for _ in range(count):
                self.skip_array(count_fmt, depth + 1)
        else:
            raise _GGUFError(f"unknown array item type {etype}")


def scan_gguf(buf, start: int, end: int, ctx: Context, label: str) -> None:
    r = _Reader(buf, start + 4, end)
    try:
        version = r.take("<I")
        if version not in (1, 2, 3):
            raise _GGUFError(f"unknown GGUF version {version}")
        count_fmt = "<I" if version == 1 else "<Q"
        n_tensors, n_kv = r.take(count_fmt), r.take(count_fmt)
        if n_kv * 13 > end - r.pos or n_tensors * 24 > end - r.pos:
            raise _GGUFError(f"header claims {n_kv} keys and {n_tensors} tensors, which cannot fit the file")
        alignment = 32
        templates = {}
        for _ in range(n_kv):
            key = r.string(count_fmt)
            value = r.value(r.take("<I"), count_fmt)
            if key == "general.alignment":
                alignment = value
            elif key.startswith("tokenizer.chat_template") and isinstance(value, str):
                templates[key] = value
        tensors = []
        for _ in range(n_tensors):
            name = r.string(count_fmt)
            n_dims = r.take("<I")
            if n_dims > MAX_GGUF_DIMS:
                raise _GGUFError(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_GGUF_DIMS})")
            dims = [r.take("<Q") for _ in range(n_dims)]
            gtype, offset = r.take("<I"), r.take("<Q")
            if gtype not in GGML_TYPES:
                raise _GGUFError(f"tensor {name!r} has unknown ggml type {gtype}")
            tensors.append((offset, name, dims, gtype))
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise _GGUFError(f"general.alignment {alignment!r} is not a power of two")
        data = start + -(-(r.pos - start) // alignment) * alignment
        tensors_end = _gguf_tensors(tensors, data, end, alignment)
    except _GGUFError as e:
        _fail(ctx, label, "gguf.header.malformed", str(e), r.pos - start)
        return
    for key, template in templates.items():
        _check_template(template, key, ctx, label)
    ctx.examined.append(f"{label}: GGUF v{version} header, {n_kv} keys, {n_tensors} tensors"
                        + (f", {len(templates)} chat template(s)" if templates else ""))
    if tensors_end + alignment <= end and n_tensors:
        from modelkit.scan.containers import trailing
        trailing(buf, tensors_end, end, ctx, label, base=start)


def _gguf_tensors(tensors: list, data: int, end: int, alignment: int) -> int:
    """Check each tensor's byte range against the file and the others; returns where the last one ends."""
    cursor = 0
    for offset, name, dims, gtype in sorted(tensors):
        block, block_bytes = GGML_TYPES[gtype]
        numel = 1
        for d in dims:
            numel *= d
        if numel % block:
            raise _GGUFError(f"tensor {name!r}: {numel} elements are not whole blocks of {block}")
        nbytes = numel // block * block_bytes
        if offset % alignment:
            raise _GGUFError(f"tensor {name!r} offset {offset} is not aligned to {alignment}")
        if offset < cursor:
            raise _GGUFError(f"tensor {name!r} overlaps the tensor before it")
        if data + offset + nbytes > end:
            raise _GGUFError(f"tensor {name!r} ({nbytes} bytes at {offset}) runs past the end of the file")
        cursor = offset + nbytes
    return data + cursor


def _check_template(template: str, key: str, ctx: Context, label: str) -> None:
    for pattern, why in _TEMPLATE_PATTERNS:
        match = pattern.search(template)
        if match:
            ctx.sink(label).add(Severity.DANGEROUS, "gguf.chat_template.injection",
                                f"{key} {why} ({match.group(0)!r}): a Jinja template-injection payload that runs "
                                "code when a runtime renders the template", name=key)
            return


def check_template(template: str, key: str, ctx: Context, label: str) -> None:
    """Chat templates found elsewhere (tokenizer_config.json) get the same check."""
    _check_template(template, key, ctx, label)
