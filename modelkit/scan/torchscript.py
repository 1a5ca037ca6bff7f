"""TorchScript archives: the code in `code/` is compiled and run by torch.jit.load, so it needs trust.

TorchScript is a restricted Python subset: it cannot import modules, but a crafted archive can
still name operators that reach the OS (`torch.ops.aten.save`, custom `torch.ops.<ns>`, file I/O
through `torch.load`/`torch.save`) and text that is not TorchScript at all is a sign of tampering.
This is a pattern check over the source text, never an execution. Standard library only.
"""
from __future__ import annotations

import builtins
import re

from modelkit.scan.model import Severity
from modelkit.scan.pickle import Limits, Sink

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

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
    """Judge one code file: the patterns above over its code with string literals blanked (a message that
    says "builtins.ValueError" is data, not a reach into builtins), and each prim::RaiseException's
    exception class, which torch imports by its qualified name when the exception reaches Python."""
    if len(content) > MAX_CODE:
        sink.add(Severity.DANGEROUS, "scan.limit.bytes", f"a code file larger than {MAX_CODE} bytes")
        return
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        sink.add(Severity.DANGEROUS, "torchscript.code.malformed", "a code file is not UTF-8 text")
        return
    code, raises = _split_literals(text)
    if code is None:     # not Python tokens: judge the raw text, strings and all (never less strict)
        sink.add(Severity.SUSPICIOUS, "torchscript.code.malformed", "a code file does not tokenize as Python; "
                 "judged as raw text")
        code = text
    for pattern, why in DANGEROUS_CODE:
        match = pattern.search(code)
        if match:
            line = code.count("\n", 0, match.start()) + 1
            sink.add(Severity.DANGEROUS, "torchscript.code.dangerous",
                     f"line {line} {why}: {match.group(0).strip()[:80]!r}", offset=match.start())
    for line, qualified in raises:
        _judge_exception(qualified, line, sink)
    for namespace in sorted(set(_OPS.findall(code)) - KNOWN_OP_NAMESPACES):
        sink.add(Severity.SUSPICIOUS, "torchscript.code.custom_op",
                 f"calls torch.ops.{namespace}, operators from a library the loading process must provide",
                 name=namespace)


_RAISE = ("ops", ".", "prim", ".", "RaiseException", "(")
_EXCEPTIONS = frozenset(name for name in dir(builtins)
                        if isinstance(getattr(builtins, name), type) and issubclass(getattr(builtins, name), BaseException))


def _split_literals(text: str) -> tuple[str | None, list[tuple[int, str | None]]]:
    """(the code with every string literal replaced by "" (its line breaks kept) and every comment removed,
    [(line, exception class name or None)] for each prim::RaiseException call); (None, []) when the text does
    not tokenize."""
    import ast
    import io
    import tokenize

    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    pieces: list[str] = []
    pos = 0
    raises: list[tuple[int, str | None]] = []
    recent: list[str] = []          # the last few significant tokens, to spot `ops.prim.RaiseException(`
    call: list[Any] | None = None   # inside a RaiseException call: [depth, line, string arguments at depth 1, commas]
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
                continue
            start = starts[tok.start[0] - 1] + tok.start[1]
            end = starts[tok.end[0] - 1] + tok.end[1]
            if tok.type == tokenize.COMMENT:        # not code either
                pieces.append(text[pos:start])
                pos = end
                continue
            if call is not None:
                if tok.type == tokenize.OP and tok.string in "([{":
                    call[0] += 1
                elif tok.type == tokenize.OP and tok.string in ")]}":
                    call[0] -= 1
                    if call[0] == 0:
                        raises.append((call[1], call[2][1] if len(call[2]) > 1 and call[3] == 1 else None))
                        call = None
                elif tok.type == tokenize.OP and tok.string == "," and call[0] == 1:
                    call[3] += 1
                elif tok.type == tokenize.STRING and call[0] == 1:
                    try:
                        value = ast.literal_eval(tok.string)
                    except (ValueError, SyntaxError):
                        value = None
                    call[2].append(value if isinstance(value, str) else "")
            if tok.type == tokenize.STRING:
                pieces.append(text[pos:start])
                pieces.append('""' + "\n" * tok.string.count("\n"))
                pos = end
            recent = [*recent[-5:], tok.string]
            if call is None and tuple(recent) == _RAISE:
                call = [1, tok.start[0], [], 0]
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return None, []
    pieces.append(text[pos:])
    return "".join(pieces), raises


def _judge_exception(qualified: str | None, line: int, sink: Sink) -> None:
    """prim::RaiseException(message, "module.Class"): torch imports `module` to raise the class. A built-in
    exception (what torch's compiler writes for `raise ValueError(...)`) is fine; any other module is imported
    when the exception is raised, so it is judged like a pickle global."""
    if qualified is None or qualified in ("", "builtins.Exception"):
        return          # no class, or one computed at run time: torch raises its own torch.jit.Error
    module, _, name = qualified.rpartition(".")
    if module == "builtins" and name in _EXCEPTIONS:
        return
    from modelkit.scan.policy import denied_reason

    reason = denied_reason(qualified)
    if reason is not None or module.split(".")[0] in ("builtins", "os", "sys", "subprocess", "importlib"):
        sink.add(Severity.DANGEROUS, "torchscript.code.dangerous",
                 f"line {line} raises {qualified!r}, which torch imports by name ({reason or 'not an exception'})",
                 name=qualified)
    elif not module.startswith(("torch", "__torch__")):
        sink.add(Severity.SUSPICIOUS, "torchscript.code.exception_class",
                 f"line {line} raises {qualified!r}: raising it imports the module {module!r}", name=qualified)
