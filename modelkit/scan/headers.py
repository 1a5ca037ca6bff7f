"""Header integrity for weight containers that run no code: safetensors and GGUF (plus GGUF chat templates).

These formats cannot run code by themselves, but a header that lies (lengths past the end of the
file, overlapping tensors, counts that make a reader allocate terabytes) crashes or misleads the
readers that trust it, and a GGUF chat template is a Jinja program some runtimes render. Every
length and count is checked against the file size before anything is read; tensor data never is.
Headers are read by modelkit.parse (safetensors.py, gguf.py); this module judges what they say.
Standard library only.
"""
from __future__ import annotations

import re

from modelkit.errors import ParseError
from modelkit.parse import ggml, gguf, safetensors
from modelkit.scan.model import Severity

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from modelkit.scan.containers import Context

def _fail(ctx: Context, label: str, rule: str, detail: str, offset: int | None = None,
          severity: Severity = Severity.DANGEROUS) -> None:
    ctx.sink(label).add(severity, rule, detail, offset=offset)


def scan_safetensors(buf, start: int, end: int, ctx: Context, label: str) -> None:
    """8-byte little-endian header length, JSON header, then the tensor bytes the offsets describe."""
    try:
        safetensors.header_length(buf, start, end)
    except ParseError as e:
        _fail(ctx, label, "safetensors.header.length", e.reason, 0)
        return
    try:
        header = safetensors.read_header(buf, start, end)
    except ParseError as e:
        _fail(ctx, label, "safetensors.header.json", e.reason, 8)
        return
    if header.duplicate_keys:
        _fail(ctx, label, "safetensors.header.duplicate", "header names a key twice; readers disagree on which wins", 8)
    data_len = end - start - header.data_start
    spans = []
    for name, info in header.entries.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                _fail(ctx, label, "safetensors.header.metadata", "__metadata__ must map strings to strings", 8,
                      Severity.SUSPICIOUS)
            continue
        problem = safetensors.tensor_problem(info, data_len)
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
        ctx.trailing(buf, start + header.data_start + cursor, end, label, base=start)


# ---------------------------------------------------------------------------------------------
# GGUF: the header is read (and bounds-checked) by modelkit.parse.gguf; here, its chat templates.

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


def scan_gguf(buf, start: int, end: int, ctx: Context, label: str) -> None:
    try:
        header = gguf.read_header(buf, start, end, versions=(1, 2, 3))
    except ParseError as e:
        ctx.sink(label).add(Severity.DANGEROUS, "gguf.header.malformed", e.reason, offset=e.offset)
        return
    templates = {key: value for key, value in header.values.items()
                 if key.startswith("tokenizer.chat_template") and isinstance(value, str)}
    for key, template in templates.items():
        _check_template(template, key, ctx, label)
    ctx.examined.append(f"{label}: GGUF v{header.version} header, {header.kv_count} keys, "
                        f"{len(header.tensors)} tensors" + (f", {len(templates)} chat template(s)" if templates else ""))
    if header.data_end + header.alignment <= end and header.tensors:
        ctx.trailing(buf, header.data_end, end, label, base=start)


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


def scan_ggml(buf, start: int, end: int, ctx: Context, label: str) -> None:
    """A legacy llama.cpp file: magic, version, hyperparameters, vocabulary and tensor records, each length held
    to the file (modelkit.parse.ggml); tensors run to the end of the file, so nothing can follow them."""
    try:
        file = ggml.read(buf[start:end] if start else buf, end - start)
    except ParseError as e:
        _fail(ctx, label, "ggml.header.malformed", e.reason, e.offset)
        return
    ctx.examined.append(f"{label}: legacy llama.cpp {file.label} file, {len(file.tokens)} tokens, "
                        f"{len(file.tensors)} tensor records checked against the file size")
