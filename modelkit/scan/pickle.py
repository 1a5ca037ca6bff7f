"""The scanner's judge of pickles: what a pickle would import and call, reported as findings.

The walk itself (opcodes, arguments, the symbolic stack machine) is modelkit.parse.pickle's; this
module overrides its hooks. Every global is judged by `policy.classify`; calls of anything that is
not a plain global (the result of another call: getattr chains, attrgetter output) are DANGEROUS;
so are malformed streams, because an unpickler runs every opcode before the one that fails
(picklescan GHSA-9gvj-pp9x-gcfr). Standard library only.
"""
from __future__ import annotations

import time

from modelkit.errors import ParseError
from modelkit.parse.pickle import (
    LEGACY_MAGIC,
    MAX_PROTOCOL,
    Global,
    Machine,
    Obj,
    PickleError,
    PickleLimit,
    PickleResult,
    PList,
    looks_like_pickle,
)
from modelkit.parse.torch_format import claimed_itemsize, legacy_records, storage_claim
from modelkit.scan.model import Finding, Record, Severity
from modelkit.scan.policy import classify

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

__all__ = ["MAX_PROTOCOL", "Limits", "PickleResult", "Sink", "StreamResult", "looks_like_pickle", "probe_pickle",
           "walk", "walk_stream"]


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


def _describe(value: Any) -> str:
    if isinstance(value, Obj):
        return f"the result of {value.origin.module}.{value.origin.name}" if value.origin else f"a {value.kind} value"
    if isinstance(value, Global):
        return f"{value.module}.{value.name}"
    return f"a {type(value).__name__.lstrip('P').lower()}"


class _Walker(Machine):
    """parse.pickle's machine, with each hook a finding."""

    def __init__(self, buf, start: int, end: int, sink: Sink, limits: Limits, deadline: float) -> None:
        super().__init__(buf, start, end, limits, deadline)
        self.sink = sink

    def judged(self) -> PickleResult:
        """Run the walk; a malformed stream or a reached limit is a DANGEROUS finding, never an exception."""
        try:
            self.run()
        except PickleLimit as e:
            self.sink.add(Severity.DANGEROUS, e.rule, f"{e.reason}; the rest of this pickle was not examined, so it "
                          "cannot be called safe", offset=e.offset)
        except PickleError as e:
            self.sink.add(Severity.DANGEROUS, "pickle.malformed",
                          f"the opcode stream is malformed ({e.reason}); an unpickler runs every opcode before this "
                          "one, so a parser confusion is treated as a bypass attempt", offset=e.offset)
        return self.result

    def named_global(self, module: str, name: str) -> None:
        verdict = classify(module, name)
        if verdict.severity > Severity.SAFE:
            self.sink.add(verdict.severity, verdict.rule, verdict.detail, offset=self.op_at, module=module, name=name)

    def unresolved_global(self, module: Any, name: Any, how: str) -> None:
        self.sink.add(Severity.DANGEROUS, "pickle.global.unresolved",
                      f"{how} names its callable with {_describe(module)} and {_describe(name)}, not "
                      "string constants: the import is computed at load time (picklescan/modelscan memo "
                      "and string-op bypasses)", offset=self.op_at)

    def dynamic_call(self, callee: Any, how: str) -> None:
        self.sink.add(Severity.DANGEROUS, "pickle.call.dynamic",
                      f"{how} calls {_describe(callee)}, a callable computed at load time "
                      "(getattr/attrgetter chains, nested calls) rather than a named global", offset=self.op_at)

    def mutate_global(self, target: Global, how: str) -> None:
        self.sink.add(Severity.DANGEROUS, "pickle.mutate.global",
                      f"{how} changes {target.module}.{target.name} itself, an importable object shared by "
                      "the whole process (modelscan #85)", offset=self.op_at,
                      module=target.module, name=target.name)

    def extension(self, name: str, code: int) -> None:
        self.sink.add(Severity.DANGEROUS, "pickle.global.extension",
                      f"{name} {code} names a callable through copyreg's extension registry, which the "
                      "loading process controls; it cannot be resolved from the file", offset=self.op_at)

    def missing_memo(self, name: str, index: int) -> None:
        self.sink.add(Severity.DANGEROUS, "pickle.memo.missing",
                      f"{name} {index} reads a memo slot that was never written (scanner-crash "
                      "bypass, picklescan PR #52)", offset=self.op_at)

    def build_on_value(self, target: Any) -> None:
        self.sink.add(Severity.DANGEROUS, "pickle.build.invalid",
                      f"BUILD on {_describe(target)}, which has no state to set; crafted stream",
                      offset=self.op_at)

    def state_set(self, keys: list[str]) -> None:
        dunders = [k for k in keys if k.startswith("__") and k.endswith("__")]
        if dunders:
            self.sink.add(Severity.DANGEROUS, "pickle.build.dunder_state",
                          f"BUILD sets {dunders[0]!r}, an interpreter attribute no checkpoint stores",
                          offset=self.op_at)

    def nested(self, pos: int) -> PickleResult:
        return walk(self.buf, pos, self.end, self.sink, self.limits, deadline=self.deadline)


def walk(buf, start: int, end: int, sink: Sink, limits: Limits = Limits(), *, deadline: float | None = None) -> PickleResult:
    """Walk one pickle from `start`; findings go to `sink`. Never raises for bad input."""
    if deadline is None:
        deadline = time.monotonic() + limits.seconds
    return _Walker(buf, start, end, sink, limits, deadline).judged()


# ---------------------------------------------------------------------------------------------
# Streams: several pickles back to back (legacy torch.save writes five), then maybe raw data.

class StreamResult:
    """The pickles of one stream, where unexplained data after the last one starts, and whether it is legacy torch."""

    __slots__ = ("pickles", "trailing", "legacy_torch")

    def __init__(self, pickles: list[PickleResult], trailing: int | None = None, legacy_torch: bool = False) -> None:
        self.pickles = pickles
        self.trailing = trailing
        self.legacy_torch = legacy_torch


def _legacy_layout(buf, pos: int, end: int, pickles: list[PickleResult]) -> int | None:
    """Skip legacy torch storage records (u64 numel, then numel * element size bytes); None if they don't fit.

    The layout is modelkit.parse.torch_format's (the pth reader reads the records through it too).
    """
    claims: dict[str, tuple[int, int]] = {}
    try:
        for pid in pickles[3].persistent_ids:
            key, storage_class, numel = storage_claim(pid)
            size = claimed_itemsize(storage_class)
            if size is None:
                return None
            claims[key] = (numel, size)
        if not isinstance(pickles[4].value, PList):
            return None
        return legacy_records(buf, pos, end, pickles[4].value, claims)[1]
    except ParseError:
        return None


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
