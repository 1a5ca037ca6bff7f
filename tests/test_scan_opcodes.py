"""Hand-built hostile pickles, one test per known bypass of picklescan, modelscan and fickling.

Every payload is harmless (`true`, `id`, `print`) and is only *dumped* or assembled from opcodes:
nothing here ever loads one (STYLE.md: scanner tests assert on scan() only). Each test cites the
advisory or issue it reproduces.
"""
from __future__ import annotations

import io
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import modelkit
from modelkit.errors import UnsafeFileError
from modelkit.scan import Limits, Severity, gate, scan
from modelkit.testing.payloads import Reduce, zip_bytes

P = pickle   # opcode constants: P.GLOBAL, P.REDUCE, ...


def _str(text: str) -> bytes:
    raw = text.encode()
    return P.SHORT_BINUNICODE + bytes([len(raw)]) + raw


def _scan(tmp_path: Path, data: bytes, name: str = "payload.pkl", **kwargs):
    path = tmp_path / name
    path.write_bytes(data)
    return scan(path, **kwargs)


def _dangerous(report, rule: str | None = None) -> None:
    assert report.worst == Severity.DANGEROUS, [(f.rule, f.callable) for f in report.findings]
    if rule is not None:
        assert rule in {f.rule for f in report.findings if f.severity == Severity.DANGEROUS}, report.findings


def test_reduce_os_system(tmp_path):
    """The classic: __reduce__ returning os.system (fickling, "Never a dill moment", 2021)."""
    for protocol in range(6):
        report = _scan(tmp_path, pickle.dumps(Reduce(os.system, "true"), protocol=protocol))
        _dangerous(report, "pickle.global.denied")
        assert any(f.name == "system" for f in report.findings)


def test_inst_opcode(tmp_path):
    """INST imports and calls in one opcode (picklescan issue #13)."""
    data = P.MARK + _str("true") + P.INST + b"os\nsystem\n" + P.STOP
    _dangerous(_scan(tmp_path, data), "pickle.global.denied")


def test_obj_opcode_pty_spawn(tmp_path):
    """OBJ with pty.spawn, missed by fickling (fickling PR #108)."""
    _dangerous(_scan(tmp_path, b'(cpty\nspawn\nS"id"\no.'), "pickle.global.denied")


def test_stack_global_memo_mixed_put_and_memoize(tmp_path):
    """BINPUT and MEMOIZE interleaved so a naive memo model sees torch._utils (picklescan issue #14)."""
    data = (P.PROTO + b"\x04" + _str("os") + P.BINPUT + b"\x00" + _str("system") + P.BINPUT + b"\x01"
            + _str("torch._utils") + P.MEMOIZE + _str("_rebuild_tensor_v2") + P.MEMOIZE
            + P.POP + P.POP + P.POP + P.POP
            + P.BINGET + b"\x00" + P.BINGET + b"\x01" + P.STACK_GLOBAL + _str("true") + P.TUPLE1 + P.REDUCE + P.STOP)
    report = _scan(tmp_path, data)
    _dangerous(report, "pickle.global.denied")
    assert ("os", "system") in {(f.module, f.name) for f in report.findings}


def test_stack_global_out_of_order_memo(tmp_path):
    """PUT to slots 2, 3, 0, 1 then GET 2, 3: memo order differs from stream order (picklescan #22, PR #23)."""
    data = b"".join([P.UNICODE + b"os\n", P.PUT + b"2\n", P.POP, P.UNICODE + b"system\n", P.PUT + b"3\n", P.POP,
                     P.UNICODE + b"torch\n", P.PUT + b"0\n", P.POP, P.UNICODE + b"LongStorage\n", P.PUT + b"1\n",
                     P.POP, P.GET + b"2\n", P.GET + b"3\n", P.STACK_GLOBAL, P.MARK, P.UNICODE + b"id\n", P.TUPLE,
                     P.REDUCE, P.STOP])
    report = _scan(tmp_path, data)
    _dangerous(report, "pickle.global.denied")
    assert ("os", "system") in {(f.module, f.name) for f in report.findings}


def test_stack_global_missing_memo(tmp_path):
    """GET of a slot never written crashed scanners into a clean verdict (picklescan PR #52, modelscan PR #348)."""
    data = P.PROTO + b"\x04" + _str("os") + P.BINGET + b"\x07" + P.STACK_GLOBAL + P.EMPTY_TUPLE + P.REDUCE + P.STOP
    report = _scan(tmp_path, data)
    _dangerous(report, "pickle.memo.missing")
    assert "pickle.global.unresolved" in {f.rule for f in report.findings}


@pytest.mark.parametrize("operand", [P.SHORT_BINBYTES + b"\x02os", P.BININT1 + b"\x2a",
                                     P.BYTEARRAY8 + struct.pack("<Q", 2) + b"os"], ids=["bytes", "int", "bytearray"])
def test_stack_global_non_string_operands(tmp_path, operand):
    """Type confusion in STACK_GLOBAL operands crashed modelscan (modelscan #338, sections 5b/5c)."""
    data = P.PROTO + b"\x05" + operand + _str("system") + P.STACK_GLOBAL + P.EMPTY_TUPLE + P.REDUCE + P.STOP
    _dangerous(_scan(tmp_path, data), "pickle.global.unresolved")


def test_build_sets_attributes_on_a_global(tmp_path):
    """BUILD on numpy.prod stores 'os'/'system' as attributes, read back by GLOBAL numpy prod.a (modelscan #85)."""
    data = (P.PROTO + b"\x05" + P.GLOBAL + b"numpy\nprod\n" + P.NONE + P.MARK + P.UNICODE + b"a\n" + P.UNICODE
            + b"os\n" + P.DICT + P.TUPLE2 + P.BUILD + P.POP + P.GLOBAL + b"numpy\nprod.a\n" + P.PUT + b"0\n"
            + P.GLOBAL + b"numpy\nprod.b\n" + P.PUT + b"1\n" + P.POP + P.POP + P.GET + b"0\n" + P.GET + b"1\n"
            + P.STACK_GLOBAL + P.UNICODE + b"true\n" + P.TUPLE1 + P.REDUCE + P.STOP)
    report = _scan(tmp_path, data)
    _dangerous(report, "pickle.mutate.global")
    assert {"pickle.global.attribute_path", "pickle.global.unresolved"} <= {f.rule for f in report.findings}


def test_numpy_builtins_through_build(tmp_path):
    """numpy.size's __builtins__ reached via BUILD, then eval called on it (modelscan #330)."""
    data = bytes.fromhex("80049566000000000000008c056e756d70798c0473697a659394948c056e756d70798c0c5f5f6275696c74"
                         "696e735f5f93949468017d7d8c0573686170656803738662680168018c046576616c86528c1d5f5f696d706f"
                         "72745f5f28226f7322292e73797374656d28226964222985522e")
    report = _scan(tmp_path, data)
    _dangerous(report, "pickle.global.dunder")
    assert "pickle.mutate.global" in {f.rule for f in report.findings}


def test_import_module_and_join_assembled_names(tmp_path):
    """importlib.import_module + getattr(str, 'join') builds 'os' at load time (modelscan #331)."""
    data = (P.PROTO + b"\x04" + _str("importlib") + _str("import_module") + P.STACK_GLOBAL + P.MEMOIZE
            + _str("builtins") + P.TUPLE1 + P.REDUCE + P.MEMOIZE + _str("builtins") + _str("getattr") + P.STACK_GLOBAL
            + P.MEMOIZE + P.BINGET + b"\x02" + P.BINGET + b"\x01" + _str("str") + P.TUPLE2 + P.REDUCE + _str("join")
            + P.TUPLE2 + P.REDUCE + _str("") + P.EMPTY_LIST + P.MARK + _str("o") + _str("s") + P.APPENDS + P.TUPLE2
            + P.REDUCE + P.STOP)
    report = _scan(tmp_path, data)
    _dangerous(report, "pickle.global.denied")
    assert "pickle.call.dynamic" in {f.rule for f in report.findings}


def test_getattr_with_concatenated_name(tmp_path):
    """getattr(builtins, 'ev' + 'al'): the name is computed, so a string match finds nothing (picklescan #66)."""
    data = (P.PROTO + b"\x04" + _str("builtins") + _str("getattr") + P.STACK_GLOBAL + _str("importlib")
            + _str("import_module") + P.STACK_GLOBAL + _str("builtins") + P.TUPLE1 + P.REDUCE
            + _str("_operator") + _str("add") + P.STACK_GLOBAL + _str("ev") + _str("al") + P.TUPLE2 + P.REDUCE
            + P.TUPLE2 + P.REDUCE + _str("print(1)") + P.TUPLE1 + P.REDUCE + P.STOP)
    report = _scan(tmp_path, data)
    _dangerous(report, "pickle.call.dynamic")
    assert {"builtins.getattr", "_operator.add"} <= {f.callable for f in report.findings}


@pytest.mark.parametrize("opcode", [P.EXT1 + b"\x01", P.EXT2 + b"\x01\x01", P.EXT4 + b"\x01\x00\x01\x00"],
                         ids=["EXT1", "EXT2", "EXT4"])
def test_extension_registry_opcodes(tmp_path, opcode):
    """EXT codes name callables via copyreg's registry, invisible to name matching (fickling PR #172,
    promptfoo/modelaudit PR #623)."""
    data = P.PROTO + b"\x02" + opcode + _str("true") + P.TUPLE1 + P.REDUCE + P.STOP
    _dangerous(_scan(tmp_path, data), "pickle.global.extension")


def test_setstate_through_build(tmp_path):
    """BUILD runs __setstate__ of any importable class; _interpreters hid behind it (fickling GHSA-6ggj-6f2q-f7mx,
    PR #302)."""
    data = (P.PROTO + b"\x04" + _str("_interpreters") + _str("create") + P.STACK_GLOBAL + P.EMPTY_TUPLE + P.NEWOBJ
            + P.EMPTY_DICT + _str("__setstate__") + _str("x") + P.SETITEM + P.BUILD + P.STOP)
    report = _scan(tmp_path, data)
    _dangerous(report, "pickle.global.denied")
    assert "pickle.build.dunder_state" in {f.rule for f in report.findings}


def test_malformed_stream_after_payload(tmp_path):
    """The unpickler runs REDUCE before it trips on a bad opcode; scanners that gave up said clean
    (picklescan GHSA-9gvj-pp9x-gcfr, PR #46)."""
    good = pickle.dumps(Reduce(os.system, "true"), protocol=2)[:-1]   # drop STOP
    report = _scan(tmp_path, good + b"\xff\xfe")
    _dangerous(report, "pickle.malformed")
    assert "pickle.global.denied" in {f.rule for f in report.findings}


def test_data_after_stop(tmp_path):
    """A second pickle after STOP: pickle.load ignores it, a loader that reads on runs it."""
    first = pickle.dumps({"weights": [1.0, 2.0]}, protocol=2)
    for second in (pickle.dumps(Reduce(os.system, "true"), protocol=0), b"cos\nsystem\n(S'true'\ntR"):
        _dangerous(_scan(tmp_path, first + second), "pickle.global.denied")


def test_multiple_pickles_payload_in_a_later_one(tmp_path):
    """Legacy torch.save writes several pickles back to back; the payload may sit in any (picklescan PR #29)."""
    parts = [pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2), pickle.dumps(1001, protocol=2),
             pickle.dumps({"protocol_version": 1001}, protocol=2), pickle.dumps(Reduce(os.system, "true"), protocol=2),
             pickle.dumps([], protocol=2)]
    _dangerous(_scan(tmp_path, b"".join(parts), name="legacy.bin"), "pickle.global.denied")


def test_pickle_inside_numpy_object_array(tmp_path):
    """An object-dtype .npy is a pickle after the header (numpy.load(allow_pickle=True) runs it)."""
    np = pytest.importorskip("numpy")
    buffer = io.BytesIO()
    np.save(buffer, np.array([Reduce(os.system, "true")], dtype=object), allow_pickle=True)
    report = _scan(tmp_path, buffer.getvalue(), name="array.npy")
    _dangerous(report, "pickle.global.denied")


def test_pickle_member_not_named_data_pkl(tmp_path):
    """Scanners that only opened *.pkl / data.pkl missed pickles under other names (picklescan GHSA-769v-p64c-89pr)."""
    evil = pickle.dumps(Reduce(os.system, "true"), protocol=2)
    data = zip_bytes({"model/data.pkl": pickle.dumps({}, protocol=2), "model/version": b"3\n",
                            "model/payload.bin": evil, "model/extra": pickle.dumps(Reduce(os.system, "id"), protocol=0)})
    report = _scan(tmp_path, data, name="model.pt")
    _dangerous(report, "pickle.global.denied")
    paths = {f.path.split(":", 1)[1] for f in report.findings if f.rule == "pickle.global.denied"}
    assert paths == {"model/payload.bin", "model/extra"}


def test_zip_encryption_flag_bit(tmp_path):
    """The encryption flag makes zipfile refuse a member that torch reads anyway (picklescan GHSA-w8jq-xcqf-f792)."""
    data = bytearray(zip_bytes({"archive/data.pkl": pickle.dumps(Reduce(os.system, "true"), protocol=2)}))
    for signature, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        at = data.find(signature)
        data[at + flag_at] |= 0x01
    report = _scan(tmp_path, bytes(data), name="model.pt")
    _dangerous(report, "pickle.global.denied")


def test_zip_duplicate_member_names(tmp_path):
    """Two members with one name: loaders and scanners pick different copies (picklescan GHSA-7q5r-7gvp-wc82)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z, pytest.warns(UserWarning):
        z.writestr("archive/data.pkl", pickle.dumps({}, protocol=2))
        z.writestr("archive/data.pkl", pickle.dumps(Reduce(os.system, "true"), protocol=2))
    report = _scan(tmp_path, out.getvalue(), name="model.pt")
    _dangerous(report, "zip.duplicate_member")
    assert "pickle.global.denied" in {f.rule for f in report.findings}


GADGETS = [  # (module, name, source): functions that reach code execution, each published as a bypass
    ("operator", "attrgetter", "picklescan GHSA-955r-x9j8-7rhh"),
    ("_operator", "methodcaller", "picklescan GHSA-46h3-79wf-xr6c"),
    ("functools", "partial", "fickling PR #210 (functools.partial wrapper)"),
    ("runpy", "_run_code", "fickling issue #36"),
    ("pip", "main", "CVE-2025-1716"),
    ("ensurepip", "_run_pip", "picklescan GHSA-xp4f-hrf8-rxw7"),
    ("pickle", "loads", "modelscan issue #267"),
    ("_pickle", "loads", "picklescan PR #25"),
    ("torch", "load", "nested torch.load (picklescan PR #47 family)"),
    ("torch.serialization", "load", "nested torch.load"),
    ("torch.utils.collect_env", "run", "picklescan GHSA-f745-w6jp-hpxx"),
    ("torch.jit.unsupported_tensor_ops", "execWrapper", "picklescan GHSA-vr7h-p6mm-wpmh, fickling #36"),
    ("torch.utils.bottleneck.__main__", "run_autograd_prof", "picklescan GHSA-4whj-rm5r-c2v8"),
    ("torch._dynamo.guards", "GuardBuilder.get", "picklescan GHSA-86cj-95qr-2p4f"),
    ("torch.fx.experimental.symbolic_shapes", "ShapeEnv.evaluate_guards_expression", "picklescan GHSA-f4x7-rfwp-v3xw"),
    ("torch.utils._config_module", "load_config", "picklescan GHSA-vv6j-3g6g-2pvj"),
    ("torch.utils.data.datapipes.utils.decoder", "basichandlers", "picklescan GHSA-h3qp-7fh3-f8h4"),
    ("timeit", "timeit", "picklescan advisories (timeit.timeit, GHSA-v7x6-rv5q-mhwc)"),
    ("cProfile", "runctx", "picklescan GHSA-9w88-8rmg-7g2p"),
    ("profile", "Profile.run", "picklescan GHSA-x696-vm39-cp64"),
    ("trace", "Trace.run", "picklescan GHSA-5qwp-399c-mjwf"),
    ("pdb", "run", "picklescan PR #29 (debuggers)"),
    ("bdb", "Bdb.run", "picklescan PR #29 (debuggers)"),
    ("code", "InteractiveInterpreter.runsource", "picklescan PR #48"),
    ("idlelib.run", "Executive.runcode", "picklescan GHSA-m869-42cg-3xwr"),
    ("doctest", "debug_script", "picklescan GHSA-fqq6-7vqf-w3fg"),
    ("lib2to3.pgen2.pgen", "ParserGenerator.make_label", "picklescan GHSA-p9w7-82w4-7q8m"),
    ("pydoc", "pipepager", "pydoc-style runners (fickling PR #210)"),
    ("webbrowser", "open", "webbrowser (fickling unsafe imports)"),
    ("shutil", "rmtree", "modelscan PR #198 (shutil)"),
    ("socket", "create_connection", "fickling issue #16"),
    ("ctypes", "CDLL", "native code loading"),
    ("importlib", "import_module", "picklescan issue #66, PR #74"),
    ("pkgutil", "resolve_name", "picklescan GHSA-vvpj-8cmc-gx39"),
    ("marshal", "loads", "picklescan PR #74"),
    ("asyncio.unix_events", "_UnixSubprocessTransport", "CVE-2025-10157"),
    ("_io", "FileIO", "CVE-2025-10156"),
    ("distutils.file_util", "write_file", "CVE-2025-10155"),
    ("numpy.f2py.crackfortran", "getlincoef", "fickling PR #210 (numpy f2py)"),
    ("numpy.testing._private.utils", "runstring", "numpy runstring (picklescan issue #42)"),
    ("numpy", "load", "nested numpy.load with pickles"),
    ("multiprocessing.util", "spawnv_passfds", "modelscan issue #338"),
    ("mlflow.projects.backend.local", "_run_entry_point", "modelscan issue #338"),
    ("pandas.io.parsers.readers", "read_csv", "modelscan issue #338 (exfiltration)"),
    ("urllib.request", "urlretrieve", "modelscan issue #338 (download)"),
    ("subprocess", "Popen", "subprocess"),
    ("__builtin__", "eval", "Python 2 name mapped to builtins by pickle's fix_imports"),
    ("commands", "getoutput", "Python 2 module mapped to subprocess"),
    ("posixpath", "os.system", "attribute path through another module's import"),
    ("builtins", "exec", "builtins exec"),
    ("builtins", "__import__", "builtins __import__"),
]


@pytest.mark.parametrize(("module", "name", "source"), GADGETS, ids=[f"{m}.{n}" for m, n, _ in GADGETS])
@pytest.mark.parametrize("protocol", [0, 4])
def test_published_gadget(tmp_path, module, name, source, protocol):
    """Each gadget below was published as a scanner bypass (source in the id table); GLOBAL (protocol 0) and
    STACK_GLOBAL (protocol 4) spellings are both caught."""
    if protocol == 0:
        data = f"c{module}\n{name}\n(S'true'\ntR.".encode()
    else:
        data = P.PROTO + b"\x04" + _str(module) + _str(name) + P.STACK_GLOBAL + _str("true") + P.TUPLE1 + P.REDUCE + P.STOP
    report = _scan(tmp_path, data)
    _dangerous(report)
    assert any(f.module == module and f.name == name for f in report.at_least(Severity.DANGEROUS)), source


@pytest.mark.parametrize(("limits", "rule"), [(Limits(max_opcodes=50), "scan.limit.opcodes"),
                                              (Limits(max_memo=5), "scan.limit.memo"),
                                              (Limits(max_depth=5), "scan.limit.depth")])
def test_limits_are_typed_findings(tmp_path, limits, rule):
    """Resource limits end the walk with a DANGEROUS finding, never an exception (fickling ResourceExhaustionError)."""
    data = P.PROTO + b"\x04" + P.MARK * 10 + (P.NONE + P.MEMOIZE + P.POP) * 40 + P.NONE + P.STOP
    _dangerous(_scan(tmp_path, data, limits=limits), rule)


def test_whole_module_pickle_needs_trust(tmp_path):
    """A whole nn.Module pickle is not malware: SUSPICIOUS 'needs trust', accepted by the gate only with trust."""
    data = (P.PROTO + b"\x02" + P.GLOBAL + b"torch.nn.modules.linear\nLinear\n" + P.EMPTY_TUPLE + P.NEWOBJ
            + P.EMPTY_DICT + _str("training") + P.NEWTRUE + P.SETITEM + P.BUILD + P.STOP)
    path = tmp_path / "whole.pt"
    path.write_bytes(data)
    report = scan(path)
    assert report.worst == Severity.SUSPICIOUS
    assert {f.rule for f in report.findings} == {"pickle.module.needs_trust"}
    with pytest.raises(UnsafeFileError, match="--trust"):
        gate(path, trust=False)
    assert gate(path, trust=True) is not None


def test_gate_refuses_dangerous_even_with_trust(tmp_path):
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps(Reduce(os.system, "true")))
    with pytest.raises(UnsafeFileError) as info:
        gate(path, trust=True)
    assert info.value.report.worst == Severity.DANGEROUS and "pickle.global.denied" in str(info.value)


def test_gate_passes_plain_data_and_refuses_unscannable(tmp_path):
    path = tmp_path / "ok.pkl"
    path.write_bytes(pickle.dumps({"a": [1, 2.0, "x"]}, protocol=2))
    assert gate(path, trust=False).worst == Severity.SAFE
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(UnsafeFileError, match="could not be scanned"):
        gate(empty, trust=True)


def test_scan_package_is_callable_in_either_import_order(tmp_path):
    """`modelkit.scan(path)` and `import modelkit.scan` agree whichever comes first; no torch is imported."""
    path = tmp_path / "ok.pkl"
    path.write_bytes(pickle.dumps([1, 2], protocol=2))
    orders = ["import modelkit; r = modelkit.scan(p); import modelkit.scan; r2 = modelkit.scan.scan(p); "
              "g = modelkit.scan.gate",
              "import modelkit.scan, modelkit; r = modelkit.scan(p); r2 = modelkit.scan.scan(p); "
              "from modelkit.scan import gate, scan as s; s(p); from modelkit import scan as s2; s2(p)"]
    for code in orders:
        result = subprocess.run([sys.executable, "-c", f"import sys; p = {str(path)!r}\n{code}\n"
                                 "assert r.worst == r2.worst\nprint('torch' in sys.modules, 'numpy' in sys.modules)"],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "False False"
    assert callable(modelkit.scan) and modelkit.scan(path).scanned == 1
