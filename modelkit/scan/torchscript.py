"""TorchScript archives: the code in `code/` is compiled and run by torch.jit.load, so it needs trust.

TorchScript is a restricted Python subset: it cannot import modules, but a crafted archive can
still name operators that reach the OS (`torch.ops.aten.save`, custom `torch.ops.<ns>`, file I/O
through `torch.load`/`torch.save`) and text that is not TorchScript at all is a sign of tampering.
This is a pattern check over the source text, never an execution. Standard library only.
"""
from __future__ import annotations

import re

from modelkit.scan.model import Severity
from modelkit.scan.pickle import Limits, Sink

MAX_CODE = 64 << 20
KNOWN_OP_NAMESPACES = frozenset({"aten", "prim", "quantized", "_quantized", "prepacked", "_caffe2", "profiler",
                                 "cuda", "_c10d_functional", "c10d", "quantized_decomposed", "mkldnn", "mkl",
                                 "xnnpack", "fbgemm", "_test"})

# (pattern, why): OS, import machinery, nested loads and file writes.
DANGEROUS_CODE = (
    (re.compile(r"^\s*(import|from)\s+(?!__torch__|torch\b|typing\b|math\b|builtins\s+import\s+(int|float|str|bool)\b)\S+",
                re.MULTILINE), "imports a module"),
    (re.compile(r"\b(os|sys|subprocess|importlib|builtins|runpy|ctypes|socket|shutil|pty)\s*\."),
     "reaches an OS or import module"),
    (re.compile(r"\b(__import__|eval|exec|compile|execfile|breakpoint)\s*\("), "calls an evaluator"),
    (re.compile(r"(?<![\w.])open\s*\("), "opens a file"),
    (re.compile(r"(?<![\w.])(load|save)\s*\(|\btorch\.(load|save|jit\.load|hub\.\w+|ops\.load_library|classes\.load_library)\s*\("),
     "loads or writes files"),
    (re.compile(r"\bops\.aten\.(save|load|_load\w*|from_file)\b"), "reads or writes files through an operator"),
    (re.compile(r"__(globals|builtins|subclasses|code|class|dict|reduce\w*|import)__"), "reaches interpreter internals"),
)
_OPS = re.compile(r"\bops\.(\w+)\.")


def trust_finding(sink: Sink, code_files: int) -> None:
    sink.add(Severity.SUSPICIOUS, "torchscript.code",
             f"a TorchScript archive: torch.jit.load compiles and runs its {code_files} code file(s), so it "
             "loads only with --trust (API: trust=True)")


def scan_code(content: bytes, sink: Sink, limits: Limits) -> None:
    if len(content) > MAX_CODE:
        sink.add(Severity.DANGEROUS, "scan.limit.bytes", f"a code file larger than {MAX_CODE} bytes")
        return
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        sink.add(Severity.DANGEROUS, "torchscript.code.malformed", "a code file is not UTF-8 text")
        return
    for pattern, why in DANGEROUS_CODE:
        match = pattern.search(text)
        if match:
            line = text.count("\n", 0, match.start()) + 1
            sink.add(Severity.DANGEROUS, "torchscript.code.dangerous",
                     f"line {line} {why}: {match.group(0).strip()[:80]!r}", offset=match.start())
    for namespace in sorted(set(_OPS.findall(text)) - KNOWN_OP_NAMESPACES):
        sink.add(Severity.SUSPICIOUS, "torchscript.code.custom_op",
                 f"calls torch.ops.{namespace}, operators from a library the loading process must provide",
                 name=namespace)
