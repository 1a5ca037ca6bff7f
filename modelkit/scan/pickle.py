"""A symbolic walk over pickle opcodes: what a pickle would import and call, found without unpickling it.

The walk mirrors the unpickler's stack machine (stack, MARK metastack, memo) with symbolic values,
so a callable is resolved however it was spelled: GLOBAL and INST lines, STACK_GLOBAL operands that
came through the memo (PUT/BINPUT/MEMOIZE then GET), Python 2 names (`__builtin__`), EXT codes.
Every global is judged by `policy.classify`; calls of anything that is not a plain global (the
result of another call: getattr chains, attrgetter output) are DANGEROUS; so are malformed streams,
because an unpickler runs every opcode before the one that fails (picklescan GHSA-9gvj-pp9x-gcfr).

Opcode metadata (codes and argument kinds) is pickletools' (a literal copy, checked by a test); arguments are
decoded here, against a bytes-like buffer (bytes or an mmap), so a length field is checked against
what is left before anything is read, and large byte payloads (tensor data in plain pickles) are
skipped, never copied. Standard library only.
"""
from __future__ import annotations

import codecs
import struct
import time

from modelkit.scan.model import Finding, Record, Severity
from modelkit.scan.policy import classify

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

# Every opcode of pickle protocols 0-5 by argument kind: {kind: "code:NAME ..."}; kinds are pickletools'
# ArgumentDescriptor names (None: no argument). A literal table, not `pickletools.opcodes`: that import
# (and pickle's) is a twentieth of `modelkit scan`'s start-up. tests/test_scan_opcodes.py checks that
# it matches pickletools exactly.
_OPCODES_BY_ARGUMENT: dict[str | None, str] = {
    None: ("\x97:NEXT_BUFFER \x98:READONLY_BUFFER N:NONE \x88:NEWTRUE \x89:NEWFALSE ]:EMPTY_LIST a:APPEND e:APPENDS "
           "l:LIST ):EMPTY_TUPLE t:TUPLE \x85:TUPLE1 \x86:TUPLE2 \x87:TUPLE3 }:EMPTY_DICT d:DICT s:SETITEM u:SETITEMS "
           "\x8f:EMPTY_SET \x90:ADDITEMS \x91:FROZENSET 0:POP 2:DUP (:MARK 1:POP_MARK \x94:MEMOIZE \x93:STACK_GLOBAL "
           "R:REDUCE b:BUILD o:OBJ \x81:NEWOBJ \x92:NEWOBJ_EX .:STOP Q:BINPERSID"),
    "decimalnl_short": "I:INT g:GET p:PUT",
    "decimalnl_long": "L:LONG",
    "int4": "J:BININT \x84:EXT4",
    "uint1": "K:BININT1 h:BINGET q:BINPUT \x82:EXT1 \x80:PROTO",
    "uint2": "M:BININT2 \x83:EXT2",
    "uint4": "j:LONG_BINGET r:LONG_BINPUT",
    "uint8": "\x95:FRAME",
    "long1": "\x8a:LONG1",
    "long4": "\x8b:LONG4",
    "stringnl": "S:STRING",
    "string1": "U:SHORT_BINSTRING",
    "string4": "T:BINSTRING",
    "bytes1": "C:SHORT_BINBYTES",
    "bytes4": "B:BINBYTES",
    "bytes8": "\x8e:BINBYTES8",
    "bytearray8": "\x96:BYTEARRAY8",
    "unicodestringnl": "V:UNICODE",
    "unicodestring1": "\x8c:SHORT_BINUNICODE",
    "unicodestring4": "X:BINUNICODE",
    "unicodestring8": "\x8d:BINUNICODE8",
    "floatnl": "F:FLOAT",
    "float8": "G:BINFLOAT",
    "stringnl_noescape": "P:PERSID",
    "stringnl_noescape_pair": "c:GLOBAL i:INST",
}
# byte -> (opcode name, argument kind or None)
_OPS: dict[int, tuple[str, str | None]] = {
    ord(entry[0]): (entry[2:], kind) for kind, entries in _OPCODES_BY_ARGUMENT.items() for entry in entries.split(" ")
}
MAX_PROTOCOL = 5
_SMALL = 4096          # byte/str arguments larger than this are not copied (no module name is that long)
_MAX_LINE = 1 << 16    # text-mode arguments (protocol 0) end within this many bytes


class Limits(Record):
    """Bounds on one pickle walk; reaching one is a DANGEROUS finding, never an exception."""

    __slots__ = ("max_opcodes", "max_memo", "max_depth", "max_pickles", "seconds")
    max_opcodes: int
    max_memo: int
    max_depth: int
    max_pickles: int
    seconds: float

    def __init__(self, *, max_opcodes: int = 20_000_000, max_memo: int = 2_000_000, max_depth: int = 10_000,
                 max_pickles: int = 64, seconds: float = 60.0) -> None:
        self._set(max_opcodes=max_opcodes, max_memo=max_memo, max_depth=max_depth, max_pickles=max_pickles,
                  seconds=seconds)


class _Mark:
    __slots__ = ()


MARK = _Mark()


class Global(Record):
    """A callable or class the pickle names (GLOBAL, INST, STACK_GLOBAL, EXT codes)."""

    __slots__ = ("module", "name")
    module: str
    name: str

    def __init__(self, module: str, name: str) -> None:
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "name", name)


class Obj(Record):
    """The result of a call, an instantiation, a persistent id or an extension code."""

    __slots__ = ("kind", "origin", "args")
    kind: str
    origin: Global | None
    args: Any

    def __init__(self, kind: str, origin: Global | None = None, args: Any = None) -> None:
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "origin", origin)
        object.__setattr__(self, "args", args)


class Blob(Record):
    """A byte or text argument too long to copy (tensor data in plain pickles)."""

    __slots__ = ("size",)
    size: int

    def __init__(self, size: int) -> None:
        object.__setattr__(self, "size", size)


class PList(list):
    pass


class PDict(list):
    """Key/value pairs; keys may be symbolic, so this is not a dict."""


class PSet(list):
    pass


class _Malformed(Exception):
    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.offset = offset


class _Limit(Exception):
    def __init__(self, rule: str, message: str, offset: int) -> None:
        super().__init__(message)
        self.rule = rule
        self.offset = offset


class PickleResult:
    """One pickle's walk: where it ended, whether it reached STOP, its value and persistent ids."""

    __slots__ = ("start", "end", "complete", "value", "opcodes", "globals", "persistent_ids")

    def __init__(self, *, start: int, end: int, complete: bool) -> None:
        self.start = start
        self.end = end
        self.complete = complete
        self.value: Any = None
        self.opcodes = 0
        self.globals: set[tuple[str, str]] = set()
        self.persistent_ids: list[Any] = []


class Sink:
    """Collects findings for one path, one per (rule, module, name): the first offset wins.

    `base` is subtracted from buffer positions, so offsets count from the start of the file or member.
    """

    def __init__(self, path: str, base: int = 0, findings: list[Finding] | None = None) -> None:
        self.path = path
        self.base = base
        self.findings: list[Finding] = findings if findings is not None else []
        self._seen: set[tuple[str, str, str]] = set()

    def add(self, severity: Severity, rule: str, detail: str, *, offset: int | None = None,
            module: str = "", name: str = "") -> None:
        key = (rule, module, name)
        if key in self._seen:
            return
        self._seen.add(key)
        self.findings.append(Finding(path=self.path, severity=severity, rule=rule, detail=detail, module=module,
                                     name=name, offset=None if offset is None else offset - self.base))


# ---------------------------------------------------------------------------------------------
# Argument decoding: each reader takes (buf, pos, end) and returns (value, new_pos).

def _need(pos: int, n: int, end: int) -> None:
    if n < 0 or pos + n > end:
        raise _Malformed(f"argument of {n} bytes runs past the end of the data", pos)


def _fixed(fmt: str):
    unpack_from, size = struct.Struct(fmt).unpack_from, struct.calcsize(fmt)

    def read(buf, pos, end):
        if pos + size > end:                    # _need, inlined: this runs for most opcodes
            raise _Malformed(f"argument of {size} bytes runs past the end of the data", pos)
        return unpack_from(buf, pos)[0], pos + size
    return read


def _line(buf, pos, end) -> tuple[bytes, int]:
    nl = buf.find(b"\n", pos, min(end, pos + _MAX_LINE))
    if nl < 0:
        raise _Malformed("text argument without a newline", pos)
    return bytes(buf[pos:nl]), nl + 1


def _counted(size_fmt: str, kind: str):
    size_reader = _fixed(size_fmt)

    def read(buf, pos, end):
        n, pos = size_reader(buf, pos, end)
        _need(pos, n, end)
        if n > _SMALL:
            return Blob(n), pos + n
        raw = bytes(buf[pos:pos + n])
        if kind == "str":
            try:
                return raw.decode("utf-8", "surrogatepass"), pos + n
            except UnicodeDecodeError as e:
                raise _Malformed("invalid UTF-8 in a string argument", pos) from e
        if kind == "latin1":   # py2 str: the unpickler decodes it to str (encoding='ASCII'/'latin1')
            return raw.decode("latin-1"), pos + n
        if kind == "long":
            return int.from_bytes(raw, "little", signed=True), pos + n
        return raw, pos + n
    return read


def _stringnl(buf, pos, end):
    raw, pos = _line(buf, pos, end)
    if len(raw) < 2 or raw[:1] != raw[-1:] or raw[:1] not in (b"'", b'"'):
        raise _Malformed("STRING argument is not quoted", pos)
    try:
        return codecs.escape_decode(raw[1:-1])[0].decode("latin-1"), pos
    except ValueError as e:
        raise _Malformed("bad escape in STRING argument", pos) from e


def _noescape(buf, pos, end):
    raw, pos = _line(buf, pos, end)
    try:
        return raw.decode("utf-8"), pos
    except UnicodeDecodeError as e:
        raise _Malformed("invalid UTF-8 in a GLOBAL/INST line", pos) from e


def _noescape_pair(buf, pos, end):
    first, pos = _noescape(buf, pos, end)
    second, pos = _noescape(buf, pos, end)
    return (first, second), pos


def _unicodenl(buf, pos, end):
    raw, pos = _line(buf, pos, end)
    try:
        return raw.decode("raw-unicode-escape"), pos
    except UnicodeDecodeError as e:
        raise _Malformed("bad escape in UNICODE argument", pos) from e


def _decimal(buf, pos, end):
    raw, pos = _line(buf, pos, end)
    text = raw.rstrip(b"L")
    if raw in (b"00", b"01"):
        return raw == b"01", pos
    try:
        return (int(text) if len(text) < 4300 else Blob(len(text))), pos
    except ValueError as e:
        raise _Malformed(f"bad integer literal {raw[:20]!r}", pos) from e


def _floatnl(buf, pos, end):
    raw, pos = _line(buf, pos, end)
    try:
        return float(raw), pos
    except ValueError as e:
        raise _Malformed(f"bad float literal {raw[:20]!r}", pos) from e


def _long4(buf, pos, end):
    n, pos = _fixed("<i")(buf, pos, end)
    _need(pos, n, end)
    if n > _SMALL:
        return Blob(n), pos + n
    return int.from_bytes(bytes(buf[pos:pos + n]), "little", signed=True), pos + n


_READERS = {
    "uint1": _fixed("<B"), "uint2": _fixed("<H"), "uint4": _fixed("<I"), "uint8": _fixed("<Q"),
    "int4": _fixed("<i"), "float8": _fixed(">d"),
    "long1": _counted("<B", "long"), "long4": _long4,
    "string1": _counted("<B", "latin1"), "string4": _counted("<i", "latin1"),
    "bytes1": _counted("<B", "bytes"), "bytes4": _counted("<I", "bytes"), "bytes8": _counted("<Q", "bytes"),
    "bytearray8": _counted("<Q", "bytes"),
    "unicodestring1": _counted("<B", "str"), "unicodestring4": _counted("<I", "str"),
    "unicodestring8": _counted("<Q", "str"),
    "stringnl": _stringnl, "stringnl_noescape": _noescape, "stringnl_noescape_pair": _noescape_pair,
    "unicodestringnl": _unicodenl, "decimalnl_short": _decimal, "decimalnl_long": _decimal, "floatnl": _floatnl,
}


# byte -> (opcode name, argument reader or None); None for bytes that are not opcodes
_TABLE: list[tuple[str, Any] | None] = [
    None if code not in _OPS else (_OPS[code][0], None if _OPS[code][1] is None else _READERS[_OPS[code][1]])
    for code in range(256)
]


# ---------------------------------------------------------------------------------------------
# The symbolic machine.

def _describe(value: Any) -> str:
    if isinstance(value, Obj):
        return f"the result of {value.origin.module}.{value.origin.name}" if value.origin else f"a {value.kind} value"
    if isinstance(value, Global):
        return f"{value.module}.{value.name}"
    return f"a {type(value).__name__.lstrip('P').lower()}"


def _dunder_keys(state: Any) -> list[str]:
    """Dunder keys in a BUILD state (a dict, or a (dict, slotstate) pair)."""
    parts = state if isinstance(state, tuple) else (state,)
    keys = []
    for part in parts:
        if isinstance(part, PDict):
            keys += [k for k, _ in part if isinstance(k, str) and k.startswith("__") and k.endswith("__")]
    return keys


class _Walker:
    def __init__(self, buf, start: int, end: int, sink: Sink, limits: Limits, deadline: float) -> None:
        self.buf, self.pos, self.end = buf, start, end
        self.sink, self.limits, self.deadline = sink, limits, deadline
        self.stack: list[Any] = []
        self.meta: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.result = PickleResult(start=start, end=start, complete=False)
        self.op_at = start

    # -- helpers
    def pop(self) -> Any:
        if not self.stack:
            raise _Malformed("stack underflow", self.op_at)
        return self.stack.pop()

    def pop_mark(self) -> list[Any]:
        if not self.meta:
            raise _Malformed("no MARK on the stack", self.op_at)
        items, self.stack = self.stack, self.meta.pop()
        return items

    def top(self) -> Any:
        if not self.stack:
            raise _Malformed("stack underflow", self.op_at)
        return self.stack[-1]

    def on_global(self, module: Any, name: Any, how: str) -> Any:
        if not (isinstance(module, str) and isinstance(name, str)):
            self.sink.add(Severity.DANGEROUS, "pickle.global.unresolved",
                          f"{how} names its callable with {_describe(module)} and {_describe(name)}, not "
                          "string constants: the import is computed at load time (picklescan/modelscan memo "
                          "and string-op bypasses)", offset=self.op_at)
            return Obj("unresolved")
        self.result.globals.add((module, name))
        verdict = classify(module, name)
        if verdict.severity > Severity.SAFE:
            self.sink.add(verdict.severity, verdict.rule, verdict.detail, offset=self.op_at, module=module, name=name)
        return Global(module, name)

    def call(self, callee: Any, how: str, args: Any = None) -> Obj:
        if isinstance(callee, Global):
            return Obj("call", callee, args if callee == _NUMPY_DTYPE else None)
        self.sink.add(Severity.DANGEROUS, "pickle.call.dynamic",
                      f"{how} calls {_describe(callee)}, a callable computed at load time "
                      "(getattr/attrgetter chains, nested calls) rather than a named global", offset=self.op_at)
        return Obj("call")

    def mutate(self, target: Any, how: str) -> None:
        if isinstance(target, Global):
            self.sink.add(Severity.DANGEROUS, "pickle.mutate.global",
                          f"{how} changes {target.module}.{target.name} itself, an importable object shared by "
                          "the whole process (modelscan #85)", offset=self.op_at,
                          module=target.module, name=target.name)

    # -- the loop (hot: locals instead of attributes where the steps allow it)
    def run(self) -> PickleResult:
        limits, buf, end, table, step = self.limits, self.buf, self.end, _TABLE, self.step
        max_opcodes = limits.max_opcodes
        count = 0
        try:
            while True:
                pos = self.pos
                if pos >= end:
                    raise _Malformed("data ends before STOP", pos)
                self.op_at = pos
                count += 1
                if count > max_opcodes:
                    raise _Limit("scan.limit.opcodes", f"more than {max_opcodes} opcodes", pos)
                if not count & 0xFFF and time.monotonic() > self.deadline:
                    raise _Limit("scan.limit.time", f"scan took longer than {limits.seconds:g} s", pos)
                spec = table[buf[pos]]
                if spec is None:
                    raise _Malformed(f"unknown opcode {buf[pos]:#04x}", pos)
                name, reader = spec
                if reader is None:
                    arg, self.pos = None, pos + 1
                else:
                    arg, self.pos = reader(buf, pos + 1, end)
                if name == "STOP":
                    self.result.value = self.pop()
                    self.result.complete = True
                    break
                step(name, arg)        # steps may move self.pos (FRAME checks it, joblib arrays skip data)
        except _Malformed as e:
            self.sink.add(Severity.DANGEROUS, "pickle.malformed",
                          f"the opcode stream is malformed ({e}); an unpickler runs every opcode before this "
                          "one, so a parser confusion is treated as a bypass attempt", offset=e.offset)
        except _Limit as e:
            self.sink.add(Severity.DANGEROUS, e.rule, f"{e}; the rest of this pickle was not examined, so it "
                          "cannot be called safe", offset=e.offset)
        self.result.end = self.pos
        self.result.opcodes = count
        return self.result

    def step(self, name: str, arg: Any) -> None:  # noqa: C901 - one branch per opcode family, like the unpickler
        stack = self.stack
        if name in _PUSH_ARG:                   # the most frequent families first
            stack.append(arg)
        elif name in _MEMO_PUT:
            index = len(self.memo) if name == "MEMOIZE" else int(arg)
            if index < 0 or index >= self.limits.max_memo:
                raise _Limit("scan.limit.memo", f"memo index {index} beyond {self.limits.max_memo}", self.op_at)
            self.memo[index] = self.top()
        elif name in _MEMO_GET:
            self.memo_get(name, int(arg))
        elif name == "MARK":
            self.meta.append(stack)
            self.stack = []
            if len(self.meta) > self.limits.max_depth:
                raise _Limit("scan.limit.depth", f"MARK nesting deeper than {self.limits.max_depth}", self.op_at)
        elif name in _CONTAINER_OPS:
            self.containers(name, arg)
        elif name == "REDUCE":
            args = self.pop()
            stack.append(self.call(self.pop(), "REDUCE", args))
        elif name in _PUSH_CONST:
            stack.append(_PUSH_CONST[name]())
        elif name in ("GLOBAL", "INST"):
            module, attr = arg
            target = self.on_global(module, attr, name)
            if name == "INST":
                self.pop_mark()
                self.stack.append(self.call(target, "INST"))
            else:
                stack.append(target)
        elif name == "STACK_GLOBAL":
            attr = self.pop()
            module = self.pop()
            stack.append(self.on_global(module, attr, "STACK_GLOBAL"))
        elif name == "NEWOBJ":
            self.pop()
            stack.append(self.call(self.pop(), "NEWOBJ"))
        elif name == "NEWOBJ_EX":
            self.pop()
            self.pop()
            stack.append(self.call(self.pop(), "NEWOBJ_EX"))
        elif name == "OBJ":
            items = self.pop_mark()
            if not items:
                raise _Malformed("OBJ without a class", self.op_at)
            self.stack.append(self.call(items[0], "OBJ"))
        elif name == "BUILD":
            self.build(self.pop(), self.top())
        elif name in ("EXT1", "EXT2", "EXT4"):
            self.sink.add(Severity.DANGEROUS, "pickle.global.extension",
                          f"{name} {arg} names a callable through copyreg's extension registry, which the "
                          "loading process controls; it cannot be resolved from the file", offset=self.op_at)
            stack.append(Obj("extension"))
        elif name in ("PERSID", "BINPERSID"):
            pid = arg if name == "PERSID" else self.pop()
            self.result.persistent_ids.append(pid)
            stack.append(Obj("persistent"))
        else:
            self.containers(name, arg)

    def memo_get(self, name: str, index: int) -> None:
        if index not in self.memo:
            self.sink.add(Severity.DANGEROUS, "pickle.memo.missing",
                          f"{name} {index} reads a memo slot that was never written (scanner-crash "
                          "bypass, picklescan PR #52)", offset=self.op_at)
            self.stack.append(Obj("missing"))
        else:
            self.stack.append(self.memo[index])

    def build(self, state: Any, target: Any) -> None:
        if isinstance(target, Global):
            self.mutate(target, "BUILD")
        elif not isinstance(target, Obj):
            self.sink.add(Severity.DANGEROUS, "pickle.build.invalid",
                          f"BUILD on {_describe(target)}, which has no state to set; crafted stream",
                          offset=self.op_at)
        if isinstance(target, Obj) and target.origin == _JOBLIB_WRAPPER and isinstance(state, PDict):
            self.joblib_array(state)
        dunders = _dunder_keys(state)
        if dunders:
            self.sink.add(Severity.DANGEROUS, "pickle.build.dunder_state",
                          f"BUILD sets {dunders[0]!r}, an interpreter attribute no checkpoint stores",
                          offset=self.op_at)

    def joblib_array(self, state: PDict) -> None:
        """joblib writes each array's bytes (or, for object arrays, a whole pickle) right after the wrapper's
        BUILD: skip the bytes, walk the pickle (joblib/numpy_pickle.py NumpyArrayWrapper.write_array)."""
        fields = {k: v for k, v in state if isinstance(k, str)}
        dtype, shape = fields.get("dtype"), fields.get("shape")
        code = dtype.args[0] if isinstance(dtype, Obj) and isinstance(dtype.args, tuple) and dtype.args else None
        if not isinstance(code, str) or not isinstance(shape, tuple) or not all(
                isinstance(d, int) and d >= 0 for d in shape):
            raise _Malformed("joblib array wrapper without a readable dtype and shape", self.op_at)
        if "O" in code:
            inner = walk(self.buf, self.pos, self.end, self.sink, self.limits, deadline=self.deadline)
            if not inner.complete:
                raise _Malformed("joblib object array without a complete pickle", self.pos)
            self.pos = inner.end
            return
        itemsize = _dtype_size(code)
        if itemsize is None:
            raise _Malformed(f"joblib array with dtype {code!r} of unknown size", self.op_at)
        if fields.get("numpy_array_alignment_bytes") is not None:
            if self.pos >= self.end:
                raise _Malformed("joblib array padding runs past the end", self.pos)
            self.pos += 1 + self.buf[self.pos]
        numel = 1
        for d in shape:
            numel *= d
        self.pos += numel * itemsize
        if self.pos > self.end:
            raise _Malformed("joblib array data runs past the end", self.op_at)

    def containers(self, name: str, arg: Any) -> None:
        stack = self.stack
        if name in ("TUPLE", "LIST", "DICT", "FROZENSET"):
            items = self.pop_mark()
            if name == "TUPLE":
                self.stack.append(tuple(items))
            elif name == "LIST":
                self.stack.append(PList(items))
            elif name == "FROZENSET":
                self.stack.append(PSet(items))
            else:
                if len(items) % 2:
                    raise _Malformed("DICT with an odd number of items", self.op_at)
                self.stack.append(PDict(zip(items[::2], items[1::2], strict=True)))
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            if len(stack) < n:
                raise _Malformed("stack underflow", self.op_at)
            items = tuple(stack[-n:])
            del stack[-n:]
            stack.append(items)
        elif name == "POP":
            if stack:
                self.pop()
            else:   # POP on an empty stack pops the mark in CPython's C unpickler
                self.pop_mark()
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            stack.append(self.top())
        elif name in ("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS"):
            items = [self.pop()] if name == "APPEND" else self.pop_mark() if name in ("APPENDS", "SETITEMS", "ADDITEMS") else None
            if name == "SETITEM":
                value, key = self.pop(), self.pop()
                items = [key, value]
            target = self.top()
            self.mutate(target, name)
            if isinstance(target, PDict) and name.startswith("SETITEM"):
                if len(items) % 2:
                    raise _Malformed(f"{name} with an odd number of items", self.op_at)
                target.extend(zip(items[::2], items[1::2], strict=True))
            elif isinstance(target, (PList, PSet)):
                target.extend(items)
        elif name in ("PROTO",):
            if arg > MAX_PROTOCOL:
                raise _Malformed(f"unsupported pickle protocol {arg}", self.op_at)
        elif name == "FRAME":
            if arg > self.end - self.pos:
                raise _Malformed(f"FRAME of {arg} bytes runs past the end of the data", self.op_at)
        elif name in ("NEXT_BUFFER", "READONLY_BUFFER"):
            if name == "NEXT_BUFFER":
                stack.append(Obj("buffer"))
            else:
                self.top()
        else:   # pragma: no cover - every opcode in the table is handled above
            raise _Malformed(f"unhandled opcode {name}", self.op_at)


_NUMPY_DTYPE = Global("numpy", "dtype")
_JOBLIB_WRAPPER = Global("joblib.numpy_pickle", "NumpyArrayWrapper")


def _dtype_size(code: str) -> int | None:
    """Bytes per element for a numpy dtype code such as 'f8', 'U5', 'b1', 'M8'."""
    kind, digits = code.lstrip("<>|=")[:1], code.lstrip("<>|=")[1:].split("[")[0]
    if not kind or not digits.isdigit():
        return 1 if kind in ("?", "b", "B") and not digits else None
    return int(digits) * (4 if kind == "U" else 1)


_PUSH_ARG = frozenset({
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "STRING", "BINSTRING", "SHORT_BINSTRING",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE",
    "BINUNICODE8", "FLOAT", "BINFLOAT",
})
_MEMO_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})
_MEMO_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})
_CONTAINER_OPS = frozenset({"TUPLE", "LIST", "DICT", "FROZENSET", "TUPLE1", "TUPLE2", "TUPLE3", "POP", "POP_MARK",
                            "DUP", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS"})
_PUSH_CONST = {
    "NONE": lambda: None, "NEWTRUE": lambda: True, "NEWFALSE": lambda: False, "EMPTY_TUPLE": tuple,
    "EMPTY_LIST": PList, "EMPTY_DICT": PDict, "EMPTY_SET": PSet,
}


def walk(buf, start: int, end: int, sink: Sink, limits: Limits = Limits(), *, deadline: float | None = None) -> PickleResult:
    """Walk one pickle from `start`; findings go to `sink`. Never raises for bad input."""
    if deadline is None:
        deadline = time.monotonic() + limits.seconds
    return _Walker(buf, start, end, sink, limits, deadline).run()


def looks_like_pickle(head: bytes) -> bool:
    """A protocol 2-5 header (PROTO n); protocols 0 and 1 have no header and are tried by walking."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= MAX_PROTOCOL


# ---------------------------------------------------------------------------------------------
# Streams: several pickles back to back (legacy torch.save writes five), then maybe raw data.

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C   # torch/serialization.py MAGIC_NUMBER
_ELEMENT_SIZE = {"Double": 8, "Float": 4, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
                 "Byte": 1, "Bool": 1, "ComplexDouble": 16, "ComplexFloat": 8, "QInt8": 1, "QUInt8": 1,
                 "QInt32": 4, "QUInt4x2": 1, "QUInt2x4": 1}


class StreamResult:
    """The pickles of one stream, where unexplained data after the last one starts, and whether it is legacy torch."""

    __slots__ = ("pickles", "trailing", "legacy_torch")

    def __init__(self, pickles: list[PickleResult], trailing: int | None = None, legacy_torch: bool = False) -> None:
        self.pickles = pickles
        self.trailing = trailing
        self.legacy_torch = legacy_torch


def _legacy_storages(pickles: list[PickleResult]) -> dict[str, tuple[int, int]] | None:
    """key -> (numel, element size) from the data pickle's ('storage', type, key, location, numel) ids."""
    out: dict[str, tuple[int, int]] = {}
    for pid in pickles[3].persistent_ids:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage" and isinstance(pid[1], Global)):
            return None
        kind = pid[1].name.removesuffix("Storage")
        size = _ELEMENT_SIZE.get(kind, 1 if kind == "Untyped" else 0)
        if not size or not isinstance(pid[2], str) or not isinstance(pid[4], int):
            return None
        out[pid[2]] = (pid[4], size)
    return out


def _legacy_layout(buf, pos: int, end: int, pickles: list[PickleResult]) -> int | None:
    """Skip legacy torch storage records (u64 numel, then numel * element size bytes); None if they don't fit."""
    keys, storages = pickles[4].value, _legacy_storages(pickles)
    if not isinstance(keys, PList) or storages is None:
        return None
    for key in keys:
        if key not in storages or pos + 8 > end:
            return None
        numel = struct.unpack_from("<Q", buf, pos)[0]
        expected, size = storages[key]
        if numel != expected and size != 1:
            return None
        pos += 8 + numel * size
        if pos > end:
            return None
    return pos


def walk_stream(buf, start: int, end: int, sink: Sink, limits: Limits = Limits(), *,
                deadline: float | None = None) -> StreamResult:
    """Walk every pickle from `start`: back-to-back pickles and legacy torch storages.

    Data after that is not examined here: `StreamResult.trailing` says where it starts, and the
    caller decides what it is (containers.trailing).
    """
    deadline = deadline if deadline is not None else time.monotonic() + limits.seconds
    pickles: list[PickleResult] = []
    pos = start
    while pos < end:
        if len(pickles) >= limits.max_pickles:
            sink.add(Severity.DANGEROUS, "scan.limit.pickles",
                     f"more than {limits.max_pickles} pickles in one stream; the rest was not examined", offset=pos)
            return StreamResult(pickles)
        result = walk(buf, pos, end, sink, limits, deadline=deadline)
        pickles.append(result)
        if not result.complete:
            return StreamResult(pickles)
        pos = result.end
        if len(pickles) == 5 and pickles[0].value == LEGACY_MAGIC:
            layout_end = _legacy_layout(buf, pos, end, pickles)
            if layout_end is None:
                sink.add(Severity.SUSPICIOUS, "torch.legacy.layout",
                         "legacy torch.save storage records do not match the pickled storage ids", offset=pos)
                return StreamResult(pickles, legacy_torch=True)
            return StreamResult(pickles, layout_end if layout_end < end else None, legacy_torch=True)
        if pos < end and not looks_like_pickle(bytes(buf[pos:pos + 2])):
            return StreamResult(pickles, pos)
    return StreamResult(pickles)


def probe_pickle(buf, pos: int, end: int, sink: Sink, limits: Limits, deadline: float) -> bool:
    """Walk data that may or may not be a pickle (protocol 0/1 has no header); report it only if it is one.

    It is one when the walk reached STOP or resolved a global with valid names: an unpickler would
    have imported that global before failing on whatever follows.
    """
    probe = Sink(sink.path, sink.base)
    result = walk(buf, pos, end, probe, limits, deadline=deadline)
    if not (result.complete or result.globals):
        return False
    for finding in probe.findings:
        sink.add(finding.severity, finding.rule, finding.detail, module=finding.module, name=finding.name,
                 offset=None if finding.offset is None else finding.offset + sink.base)
    return True
