"""Pickle opcodes, read symbolically: what a pickle would import, call and build, found without unpickling it.

`Machine` mirrors the unpickler's stack machine (stack, MARK metastack, memo) with symbolic values,
so a callable is resolved however it was spelled: GLOBAL and INST lines, STACK_GLOBAL operands that
came through the memo (PUT/BINPUT/MEMOIZE then GET), Python 2 names (`__builtin__`), EXT codes. It
judges nothing: the scanner (modelkit.scan.pickle) subclasses it and turns its hooks into findings;
the pth converter runs it as is for the globals and storages a checkpoint names.

Opcodes and their arguments are decoded by modelkit.parse.pickle_opcodes (every length checked before
anything is read). Malformed streams raise PickleError, reached limits PickleLimit (both ParseError).
Standard library only.
"""
from __future__ import annotations

import time

from modelkit.errors import ParseError
from modelkit.parse.pickle_opcodes import (
    _TABLE,
    LEGACY_MAGIC,
    MAX_PROTOCOL,
    Blob,
    PickleError,
    looks_like_pickle,
)

__all__ = ["LEGACY_MAGIC", "MARK", "MAX_PROTOCOL", "Blob", "Bounds", "Global", "Machine", "Obj", "PDict",
           "PList", "PSet", "PickleError", "PickleLimit", "PickleResult", "looks_like_pickle", "walk"]

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any


class PickleLimit(ParseError):
    """A bound of the walk was reached (`rule` names which: scan.limit.opcodes, .memo, .depth, .time)."""

    def __init__(self, rule: str, message: str, offset: int) -> None:
        super().__init__(message, offset=offset)
        self.rule = rule


class Bounds:
    """Limits for a walk outside the scanner (the scanner passes its own `Limits`): opcodes, memo
    slots, MARK depth, and seconds."""

    __slots__ = ("max_opcodes", "max_memo", "max_depth", "seconds")

    def __init__(self, *, max_opcodes: int = 20_000_000, max_memo: int = 2_000_000, max_depth: int = 10_000,
                 seconds: float = 60.0) -> None:
        self.max_opcodes, self.max_memo, self.max_depth, self.seconds = max_opcodes, max_memo, max_depth, seconds


class _Mark:
    __slots__ = ()


MARK = _Mark()


class Global:
    """A callable or class the pickle names (GLOBAL, INST, STACK_GLOBAL)."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __eq__(self, other: object) -> bool:
        return type(other) is Global and (other.module, other.name) == (self.module, self.name)

    def __hash__(self) -> int:
        return hash((self.module, self.name))

    def __repr__(self) -> str:
        return f"Global({self.module!r}, {self.name!r})"


class Obj:
    """The result of a call, an instantiation, a persistent id or an extension code."""

    __slots__ = ("kind", "origin", "args")

    def __init__(self, kind: str, origin: Global | None = None, args: Any = None) -> None:
        self.kind, self.origin, self.args = kind, origin, args

    def __repr__(self) -> str:
        return f"Obj({self.kind!r}, {self.origin!r})"


class PList(list):
    pass


class PDict(list):
    """Key/value pairs; keys may be symbolic, so this is not a dict."""


class PSet(list):
    pass


class PickleResult:
    """One pickle's walk: where it ended, whether it reached STOP, its value, the globals it names (in
    order of first appearance), its persistent ids, and the string keys of the states BUILD set."""

    __slots__ = ("start", "end", "complete", "value", "opcodes", "globals", "persistent_ids", "build_keys")

    def __init__(self, *, start: int, end: int, complete: bool) -> None:
        self.start = start
        self.end = end
        self.complete = complete
        self.value: Any = None
        self.opcodes = 0
        self.globals: dict[tuple[str, str], None] = {}
        self.persistent_ids: list[Any] = []
        self.build_keys: set[str] = set()


# ---------------------------------------------------------------------------------------------
# The symbolic machine.

def _state_keys(state: Any) -> list[str]:
    """String keys of a BUILD state (a dict, or a (dict, slotstate) pair)."""
    parts = state if isinstance(state, tuple) else (state,)
    return [k for part in parts if isinstance(part, PDict) for k, _ in part if isinstance(k, str)]


class Machine:
    """The unpickler's stack machine over buf[start:end], with symbolic values; `run()` walks one pickle.

    Args:
        buf: bytes or an mmap.
        start, end: the pickle's extent (it may stop before `end`; `result.end` says where).
        limits: any object with max_opcodes, max_memo, max_depth and seconds (modelkit.scan.Limits).
        deadline: time.monotonic() value after which the walk stops (PickleLimit "scan.limit.time").

    The hooks below do nothing here; the scanner overrides them to report what they see.
    """

    def __init__(self, buf, start: int, end: int, limits: Any, deadline: float) -> None:
        self.buf, self.pos, self.end = buf, start, end
        self.limits, self.deadline = limits, deadline
        self.stack: list[Any] = []
        self.meta: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.result = PickleResult(start=start, end=start, complete=False)
        self.op_at = start

    # -- helpers
    def pop(self) -> Any:
        if not self.stack:
            raise PickleError("stack underflow", offset=self.op_at)
        return self.stack.pop()

    def pop_mark(self) -> list[Any]:
        if not self.meta:
            raise PickleError("no MARK on the stack", offset=self.op_at)
        items, self.stack = self.stack, self.meta.pop()
        return items

    def top(self) -> Any:
        if not self.stack:
            raise PickleError("stack underflow", offset=self.op_at)
        return self.stack[-1]

    def on_global(self, module: Any, name: Any, how: str) -> Any:
        if not (isinstance(module, str) and isinstance(name, str)):
            self.unresolved_global(module, name, how)
            return Obj("unresolved")
        self.result.globals[(module, name)] = None
        self.named_global(module, name)
        return Global(module, name)

    def call(self, callee: Any, how: str, args: Any = None) -> Obj:
        if isinstance(callee, Global):
            return Obj("call", callee, args if callee == NUMPY_DTYPE else None)
        self.dynamic_call(callee, how)
        return Obj("call")

    def mutate(self, target: Any, how: str) -> None:
        if isinstance(target, Global):
            self.mutate_global(target, how)

    # -- hooks: what a judge of the pickle wants to hear about (the scanner overrides them)
    def named_global(self, module: str, name: str) -> None:
        """A global named by string constants (GLOBAL, INST, STACK_GLOBAL)."""

    def unresolved_global(self, module: Any, name: Any, how: str) -> None:
        """STACK_GLOBAL with operands that are not string constants: the import is computed at load time."""

    def dynamic_call(self, callee: Any, how: str) -> None:
        """A call of something that is not a named global (the result of another call, ...)."""

    def mutate_global(self, target: Global, how: str) -> None:
        """BUILD/SETITEM/APPEND on an importable object itself."""

    def extension(self, name: str, code: int) -> None:
        """EXT1/2/4: a callable named through copyreg's extension registry."""

    def missing_memo(self, name: str, index: int) -> None:
        """GET of a memo slot never written."""

    def build_on_value(self, target: Any) -> None:
        """BUILD on a value that has no state to set (a literal, a container)."""

    def state_set(self, keys: list[str]) -> None:
        """BUILD set a state with these string keys."""

    def nested(self, pos: int) -> PickleResult:
        """Walk a pickle embedded at `pos` (joblib object arrays) with the same judge."""
        return type(self)(self.buf, pos, self.end, self.limits, self.deadline).run()

    # -- the loop (hot: locals instead of attributes where the steps allow it)
    def run(self) -> PickleResult:
        """Walk one pickle to its STOP; returns the result.

        Raises:
            PickleError: the stream is malformed (the result so far stays in `self.result`).
            PickleLimit: a limit was reached.
        """
        limits, buf, end, table, step = self.limits, self.buf, self.end, _TABLE, self.step
        max_opcodes = limits.max_opcodes
        count = 0
        try:
            while True:
                pos = self.pos
                if pos >= end:
                    raise PickleError("data ends before STOP", offset=pos)
                self.op_at = pos
                count += 1
                if count > max_opcodes:
                    raise PickleLimit("scan.limit.opcodes", f"more than {max_opcodes} opcodes", pos)
                if not count & 0xFFF and time.monotonic() > self.deadline:
                    raise PickleLimit("scan.limit.time", f"scan took longer than {limits.seconds:g} s", pos)
                spec = table[buf[pos]]
                if spec is None:
                    raise PickleError(f"unknown opcode {buf[pos]:#04x}", offset=pos)
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
        finally:
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
                raise PickleLimit("scan.limit.memo", f"memo index {index} beyond {self.limits.max_memo}", self.op_at)
            self.memo[index] = self.top()
        elif name in _MEMO_GET:
            self.memo_get(name, int(arg))
        elif name == "MARK":
            self.meta.append(stack)
            self.stack = []
            if len(self.meta) > self.limits.max_depth:
                raise PickleLimit("scan.limit.depth", f"MARK nesting deeper than {self.limits.max_depth}", self.op_at)
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
                raise PickleError("OBJ without a class", offset=self.op_at)
            self.stack.append(self.call(items[0], "OBJ"))
        elif name == "BUILD":
            self.build(self.pop(), self.top())
        elif name in ("EXT1", "EXT2", "EXT4"):
            self.extension(name, arg)
            stack.append(Obj("extension"))
        elif name in ("PERSID", "BINPERSID"):
            pid = arg if name == "PERSID" else self.pop()
            self.result.persistent_ids.append(pid)
            stack.append(Obj("persistent"))
        else:
            self.containers(name, arg)

    def memo_get(self, name: str, index: int) -> None:
        if index not in self.memo:
            self.missing_memo(name, index)
            self.stack.append(Obj("missing"))
        else:
            self.stack.append(self.memo[index])

    def build(self, state: Any, target: Any) -> None:
        if isinstance(target, Global):
            self.mutate_global(target, "BUILD")
        elif not isinstance(target, Obj):
            self.build_on_value(target)
        if isinstance(target, Obj) and target.origin == _JOBLIB_WRAPPER and isinstance(state, PDict):
            self.joblib_array(state)
        keys = _state_keys(state)
        if keys:
            self.result.build_keys.update(keys)
            self.state_set(keys)

    def joblib_array(self, state: PDict) -> None:
        """joblib writes each array's bytes (or, for object arrays, a whole pickle) right after the wrapper's
        BUILD: skip the bytes, walk the pickle (joblib/numpy_pickle.py NumpyArrayWrapper.write_array)."""
        fields = {k: v for k, v in state if isinstance(k, str)}
        dtype, shape = fields.get("dtype"), fields.get("shape")
        code = dtype.args[0] if isinstance(dtype, Obj) and isinstance(dtype.args, tuple) and dtype.args else None
        if not isinstance(code, str) or not isinstance(shape, tuple) or not all(
                isinstance(d, int) and d >= 0 for d in shape):
            raise PickleError("joblib array wrapper without a readable dtype and shape", offset=self.op_at)
        if "O" in code:
            inner = self.nested(self.pos)
            if not inner.complete:
                raise PickleError("joblib object array without a complete pickle", offset=self.pos)
            self.pos = inner.end
            return
        itemsize = _dtype_size(code)
        if itemsize is None:
            raise PickleError(f"joblib array with dtype {code!r} of unknown size", offset=self.op_at)
        if fields.get("numpy_array_alignment_bytes") is not None:
            if self.pos >= self.end:
                raise PickleError("joblib array padding runs past the end", offset=self.pos)
            self.pos += 1 + self.buf[self.pos]
        numel = 1
        for d in shape:
            numel *= d
        self.pos += numel * itemsize
        if self.pos > self.end:
            raise PickleError("joblib array data runs past the end", offset=self.op_at)

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
                    raise PickleError("DICT with an odd number of items", offset=self.op_at)
                self.stack.append(PDict(zip(items[::2], items[1::2], strict=True)))
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            if len(stack) < n:
                raise PickleError("stack underflow", offset=self.op_at)
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
                    raise PickleError(f"{name} with an odd number of items", offset=self.op_at)
                target.extend(zip(items[::2], items[1::2], strict=True))
            elif isinstance(target, (PList, PSet)):
                target.extend(items)
        elif name in ("PROTO",):
            if arg > MAX_PROTOCOL:
                raise PickleError(f"unsupported pickle protocol {arg}", offset=self.op_at)
        elif name == "FRAME":
            if arg > self.end - self.pos:
                raise PickleError(f"FRAME of {arg} bytes runs past the end of the data", offset=self.op_at)
        elif name in ("NEXT_BUFFER", "READONLY_BUFFER"):
            if name == "NEXT_BUFFER":
                stack.append(Obj("buffer"))
            else:
                self.top()
        else:   # pragma: no cover - every opcode in the table is handled above
            raise PickleError(f"unhandled opcode {name}", offset=self.op_at)


NUMPY_DTYPE = Global("numpy", "dtype")
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


def walk(buf, start: int, end: int, limits: Any = Bounds(), *, deadline: float | None = None) -> PickleResult:
    """Walk one pickle from `start` with no judge (see Machine.run for what it raises)."""
    if deadline is None:
        deadline = time.monotonic() + limits.seconds
    return Machine(buf, start, end, limits, deadline).run()
