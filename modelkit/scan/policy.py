"""What a pickle may import: an allowlist with a reason per entry, and the patterns that make a finding dangerous.

Anything a pickle references that is not in `ALLOWED` is at least SUSPICIOUS. `DENIED` prefixes
(matched against the full dotted path `module.name`, after Python 2 names are mapped to Python 3
ones exactly as `pickle` does) make it DANGEROUS, and so do a few structural signs no legitimate
checkpoint shows: dunder names, attribute paths (`posixpath` + `os.system`), private stdlib
modules, and names that say they execute (`run`, `system`, `spawn*`, ...).

The torch entries mirror `torch._weights_only_unpickler._get_allowed_globals()` (torch 2.13), so
what passes here is what `torch.load(weights_only=True)` accepts, plus numpy's array rebuild.
Standard library only.
"""
from __future__ import annotations

import _compat_pickle
import re

from modelkit.scan.model import Record, Severity

_TENSOR = "rebuilds a tensor from a storage reference and shape metadata; reads no files and runs no code"
_STORAGE = "a storage type tag used in torch's persistent ids; constructs nothing by itself"
_DTYPE = "a dtype singleton; only looked up, never called with data"
_QSCHEME = "a quantization-scheme singleton; only looked up"

_TORCH_DTYPES = (
    "bfloat16 bits16 bits1x8 bits2x4 bits4x2 bits8 bool complex128 complex32 complex64 float16 float32 float64 "
    "float4_e2m1fn_x2 float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu half float double "
    "int1 int2 int3 int4 int5 int6 int7 int8 int16 int32 int64 long short int cfloat cdouble qint32 qint8 quint2x4 "
    "quint4x2 quint8 uint1 uint2 uint3 uint4 uint5 uint6 uint7 uint8 uint16 uint32 uint64"
).split()
_TORCH_STORAGES = (
    "BFloat16 Bool Byte Char ComplexDouble ComplexFloat Double Float Half Int Long QInt32 QInt8 QUInt2x4 QUInt4x2 "
    "QUInt8 Short"
).split()
_TORCH_TENSORS = "BFloat16 Bool Byte Char Double Float Half Int Long Short".split()

# module -> {name: why it is safe}. Only what legitimate checkpoints need.
ALLOWED: dict[str, dict[str, str]] = {
    "collections": {
        "OrderedDict": "the dict type of every state_dict; builds a mapping, runs no code",
        "Counter": "a dict subclass; torch's weights_only loader allows it too",
    },
    "_codecs": {"encode": "how protocol-2 pickles store bytes (str -> bytes with a named codec)"},
    "builtins": {
        "set": "builds a set from its items", "frozenset": "builds a frozenset from its items",
        "bytearray": "builds a bytearray", "complex": "builds a complex number", "slice": "builds a slice",
        "bytes": "builds bytes", "object": "base class passed to copyreg._reconstructor",
    },
    "copyreg": {
        "_reconstructor": "protocol 0/1 object rebuild (base.__new__(cls)); the class itself is classified on its own",
    },
    "torch": {
        "Size": "a tuple subclass for shapes",
        "device": "names a device such as 'cpu'; opens nothing",
        "Tensor": "the tensor class, used by tensor subclass rebuilds",
        "per_tensor_affine": _QSCHEME, "per_tensor_symmetric": _QSCHEME, "per_channel_affine": _QSCHEME,
        "per_channel_symmetric": _QSCHEME, "per_channel_affine_float_qparams": _QSCHEME,
        "strided": "a layout singleton", "sparse_coo": "a layout singleton", "sparse_csr": "a layout singleton",
        "contiguous_format": "a memory-format singleton", "channels_last": "a memory-format singleton",
        **{name: _DTYPE for name in _TORCH_DTYPES},
        **{f"{kind}Storage": _STORAGE for kind in _TORCH_STORAGES},
        **{f"{kind}Tensor": "a legacy tensor type tag" for kind in _TORCH_TENSORS},
    },
    "torch.cuda": {f"{kind}Storage": _STORAGE for kind in _TORCH_STORAGES if not kind.startswith("Q")},
    "torch.storage": {"UntypedStorage": _STORAGE, "TypedStorage": _STORAGE},
    "torch.nn.parameter": {"Parameter": "a tensor subclass flagged requires_grad; rebuilt from tensor data"},
    "torch.serialization": {"_get_layout": "maps a layout name such as 'torch.strided' to the layout object"},
    "torch._tensor": {"_rebuild_from_type_v2": "rebuilds a tensor subclass through an allowed rebuild function"},
    "torch._utils": {name: _TENSOR for name in (
        "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
        "_rebuild_parameter_with_state", "_rebuild_qtensor", "_rebuild_sparse_tensor",
        "_rebuild_meta_tensor_no_storage", "_rebuild_nested_tensor", "_rebuild_wrapper_subclass",
        "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor")},
    # TorchScript archives: read by the C++ unpickler, which resolves only these helpers.
    "torch.jit._pickle": {name: "TorchScript list/tensor builder resolved by the C++ unpickler" for name in (
        "restore_type_tag", "build_intlist", "build_tensorlist", "build_doublelist", "build_boollist",
        "build_tensor_from_id")},
    "numpy": {"ndarray": "the array type passed to _reconstruct", "dtype": "builds a dtype from its code"},
    **{mod: {"_reconstruct": "allocates an empty ndarray that BUILD then fills with raw bytes",
             "scalar": "builds a numpy scalar from a dtype and raw bytes"}
       for mod in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{mod: {"_frombuffer": "protocol-5 array rebuild from a byte buffer, dtype and shape"}
       for mod in ("numpy.core.numeric", "numpy._core.numeric")},
    "numpy.random._pickle": {
        "__randomstate_ctor": "recreates a RandomState by generator name (a lookup in numpy's own table)",
        "__generator_ctor": "recreates a Generator by generator name",
        "__bit_generator_ctor": "recreates a bit generator by name",
    },
    "joblib.numpy_pickle": {"NumpyArrayWrapper": "describes an array whose raw bytes joblib writes right after it"},
    "argparse": {"Namespace": "a plain attribute bag; older training checkpoints store their CLI args this way"},
    # Training scripts save their paths and enums with the weights. A path object is a string with structure:
    # building one (cls(*parts)) touches no file; reading or writing needs its methods, which a pickle
    # reaches only through getattr (denied). Python 3.13 moved the classes to pathlib._local.
    **{mod: {name: "a path value (cls(*parts)); constructing it opens, reads and writes nothing"
             for name in ("Path", "PurePath", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")}
       for mod in ("pathlib", "pathlib._local")},
    "re": {"RegexFlag": "an enum of regular-expression flags; RegexFlag(value) looks the member up"},
    "http": {"HTTPStatus": "an enum of HTTP status codes; HTTPStatus(value) looks the member up (opens nothing)"},
}
# numpy scalar types pickled as themselves (a dtype argument, a config value): looked up, never called with data
# beyond a number.
for _name in ("bool_", "float16", "float32", "float64", "longdouble", "int8", "int16", "int32", "int64", "uint8",
              "uint16", "uint32", "uint64", "complex64", "complex128", "intc", "uintc", "intp", "uintp", "generic",
              "number", "integer", "floating", "str_", "bytes_"):
    ALLOWED["numpy"][_name] = "a numpy scalar type; calling it converts a number"
for _name in ("Float64DType", "Float32DType", "Float16DType", "Int64DType", "Int32DType", "Int16DType",
              "Int8DType", "UInt8DType", "UInt16DType", "UInt32DType", "UInt64DType", "BoolDType",
              "Complex64DType", "Complex128DType", "LongDType", "ULongDType"):
    ALLOWED.setdefault("numpy.dtypes", {})[_name] = "a numpy 2 dtype class, looked up for dtype rebuilds"

# Full dotted prefixes (module.name) that run code, import modules, touch files, processes or the
# network, or reach back into a pickle loader. A finding on any of them is DANGEROUS.
DENIED: dict[str, str] = {
    "builtins.eval": "evaluates a string as Python", "builtins.exec": "executes a string as Python",
    "builtins.compile": "compiles source to a code object", "builtins.__import__": "imports any module",
    "builtins.getattr": "reaches any attribute (getattr chains lead to os.system)",
    "builtins.setattr": "changes any attribute", "builtins.delattr": "removes any attribute",
    "builtins.open": "opens files", "builtins.input": "reads stdin", "builtins.breakpoint": "starts a debugger",
    "builtins.globals": "exposes module globals", "builtins.locals": "exposes locals", "builtins.vars": "exposes __dict__",
    "builtins.type": "creates classes at load time", "builtins.super": "reaches parent methods",
    "builtins.help": "starts pydoc", "builtins.exit": "exits", "builtins.quit": "exits",
    "builtins.memoryview": "raw memory access", "builtins.execfile": "executes a file", "builtins.apply": "calls anything",
    "builtins.reload": "re-imports a module", "builtins.file": "opens files", "builtins.__build_class__": "creates classes",
    "os": "operating-system access (system, popen, exec*, spawn*, file writes)", "posix": "os on POSIX",
    "nt": "os on Windows", "posixpath.os": "os through posixpath", "ntpath.os": "os through ntpath",
    "subprocess": "starts processes", "_posixsubprocess": "starts processes", "multiprocessing": "starts processes",
    "concurrent": "runs callables in workers", "asyncio": "starts subprocesses and sockets",
    "threading": "runs callables in threads", "_thread": "runs callables in threads",
    "sys": "interpreter internals (modules, hooks, exit)", "runpy": "runs modules and files (_run_code)",
    "importlib": "imports any module", "_imp": "import machinery", "imp": "import machinery",
    "zipimport": "imports code from archives", "pkgutil": "resolve_name reaches any object",
    "ctypes": "calls native code", "_ctypes": "calls native code", "cffi": "calls native code",
    "pty": "spawns shells", "socket": "network access", "_socket": "network access", "ssl": "network access",
    "http": "network access", "urllib": "network access", "urllib2": "network access", "urllib3": "network access",
    "httplib": "network access", "ftplib": "network access", "smtplib": "network access",
    "telnetlib": "network access", "xmlrpc": "network access", "requests": "network access",
    "aiohttp": "network access", "webbrowser": "opens a browser with any URL", "shutil": "copies and deletes files",
    "tempfile": "creates files", "io": "opens files", "_io": "opens files (FileIO)", "codecs.open": "opens files",
    "pathlib": "reads and writes files", "glob": "lists files", "fileinput": "reads files",
    "code": "interactive interpreter (InteractiveInterpreter.runsource)", "codeop": "compiles source",
    "pdb": "debugger that runs code", "bdb": "debugger that runs code (Bdb.run)", "timeit": "timeit runs statements",
    "cProfile": "profiler runs statements", "profile": "profiler runs statements", "trace": "tracer runs code",
    "pydoc": "pydoc.pipepager/locate run commands and import modules", "doctest": "runs docstring code",
    "idlelib": "IDE helpers that run code", "lib2to3": "code tooling", "ensurepip": "runs pip (_run_pip)",
    "pip": "installs packages (pip.main)", "venv": "creates environments and runs pip",
    "distutils": "build tooling (spawn, write_file)", "setuptools": "build tooling", "site": "alters sys.path",
    "marshal": "loads code objects", "types": "constructs functions and code objects",
    "pickle": "a nested pickle load", "_pickle": "a nested pickle load", "cPickle": "a nested pickle load",
    "dill": "a nested pickle load", "cloudpickle": "a nested pickle load", "joblib": "a nested pickle load",
    "shelve": "a nested pickle load", "dbm": "opens databases", "sqlite3": "opens databases",
    "operator": "attrgetter/methodcaller/getitem build getattr chains", "_operator": "attrgetter/methodcaller chains",
    "functools.partial": "binds arguments to any callable (partial chains)",
    "functools.reduce": "applies any callable repeatedly (reduce(getattr, ...))",
    "inspect": "reaches frames and globals", "gc": "reaches every live object", "signal": "installs handlers",
    "atexit": "registers callables to run at exit", "weakref.finalize": "registers a callable to run later",
    "copyreg.add_extension": "rewrites the EXT opcode table",
    "logging.config": "listen()/fileConfig evaluate configuration code", "mmap": "maps files",
    "fcntl": "file-descriptor control", "resource": "process limits", "platform": "runs commands",
    "zipfile": "extracts archives to disk", "tarfile": "extracts archives to disk", "mailcap": "runs commands",
    "_interpreters": "runs source in a subinterpreter", "_xxsubinterpreters": "runs source in a subinterpreter",
    "_testcapi": "native test hooks", "_testinternalcapi": "native test hooks",
    "yaml": "yaml.load builds arbitrary objects", "jinja2": "renders templates with code",
    "torch.load": "a nested torch.load", "torch.save": "writes files", "torch.jit": "loads and runs TorchScript",
    "torch.hub": "downloads and runs code", "torch.serialization": "nested loads and file access",
    "torch.package": "loads packaged code", "torch.utils.cpp_extension": "compiles and loads native code",
    "torch.utils.collect_env": "runs shell commands (run)", "torch.utils.bottleneck": "runs profilers on scripts", "torch.utils.data": "starts worker processes",
    "torch._dynamo": "compiles and runs code", "torch._inductor": "compiles and runs code",
    "torch.compile": "compiles code", "torch.distributed": "rpc and network access",
    "torch.multiprocessing": "starts processes", "torch.ops": "calls any registered operator",
    "torch._ops": "calls any registered operator", "torch.fx": "GraphModule rebuild executes Python source",
    "torch._C": "native bindings (jit import, file access)", "torch.library": "registers operators",
    "torch.testing": "test runners", "torch.export": "loads exported programs", "torch.onnx": "writes files",
    "torch.classes": "TorchScript custom classes", "torch._classes": "TorchScript custom classes",
    "torch.from_file": "maps files", "torch.storage._load_from_bytes": "a nested torch.load",
    "torch._weights_only_unpickler": "loader internals", "torch.backends": "changes global state",
    "numpy.load": "loads pickles (allow_pickle)", "numpy.save": "writes files", "numpy.savez": "writes files",
    "numpy.savetxt": "writes files", "numpy.loadtxt": "reads files", "numpy.genfromtxt": "reads files",
    "numpy.fromfile": "reads files", "numpy.memmap": "maps files", "numpy.fromregex": "reads files",
    "numpy.DataSource": "downloads files", "numpy.lib": "npyio/format/_datasource/utils load pickles and files",
    "numpy.testing": "runs strings and subprocesses (runstring)", "numpy.f2py": "evaluates Fortran expressions",
    "numpy.distutils": "runs compilers", "numpy.ctypeslib": "loads native libraries",
    "numpy.core._internal": "ctypes access", "numpy._core._internal": "ctypes access",
    "numpy.frompyfunc": "wraps any callable", "numpy.vectorize": "wraps any callable",
    "numpy.apply_along_axis": "calls any callable", "numpy.apply_over_axes": "calls any callable",
    "numpy.piecewise": "calls any callable", "numpy.load_library": "loads native libraries",
    "pandas.read_csv": "reads files and URLs", "pandas.read_pickle": "a nested pickle load", "pandas.io": "file and URL access",
    "keras.models": "loads models (Lambda layers)", "keras.saving": "loads models", "tensorflow.io": "file access",
    "tensorflow.keras.models": "loads models", "huggingface_hub": "downloads files", "transformers.dynamic_module_utils": "runs remote code",
    "mlflow": "runs projects and downloads",
    # Standard-library classes and functions whose construction or call alone opens files, sockets or
    # processes: a pickle's REDUCE is enough to trigger them, so they are denied outright, not merely unknown.
    "logging": "handlers (FileHandler, SocketHandler, basicConfig(filename=...)) create files and connect sockets",
    "socketserver": "servers bind and listen on sockets", "asyncore": "socket dispatchers", "asynchat": "socket channels",
    "smtpd": "an SMTP server", "imaplib": "connects to mail servers", "poplib": "connects to mail servers",
    "nntplib": "connects to news servers", "wsgiref": "make_server binds sockets", "selectors": "watches sockets",
    "gzip": "GzipFile/open create and write files", "bz2": "BZ2File/open create and write files",
    "lzma": "LZMAFile/open create and write files", "wave": "open creates and writes files",
    "aifc": "open creates and writes files", "sunau": "open creates and writes files",
    "mailbox": "mailboxes create folders and files", "py_compile": "compiles source and writes .pyc files",
    "compileall": "compiles and writes files", "zipapp": "writes archives", "pipes": "runs shell pipelines",
    "linecache": "reads any file", "netrc": "reads credential files", "filecmp": "reads files",
    "pstats": "Stats(file) reads marshal data", "uuid.getnode": "runs ifconfig/ipconfig to find a MAC address",
    "tkinter": "opens windows and runs Tcl", "turtle": "opens windows and runs Tcl", "curses": "takes over the terminal",
    "readline": "reads and writes history files", "xml.dom.minidom.parse": "reads files and URLs",
    "xml.sax": "parsers fetch external entities (files, URLs)", "xml.etree.ElementTree.parse": "reads files",
    "mimetypes.init": "reads files", "gettext": "translation() reads files", "sched": "runs scheduled callables",
    "configparser": "read() reads files", "plistlib.load": "reads files", "shlex": "reads files with the source command",
    "cgi": "reads request files and environment", "cgitb": "writes tracebacks to files",
    "syslog": "writes to the system log", "getpass": "reads the terminal", "crypt": "native crypt(3)",
}

# Whole-module pickles: code that is not malware, but that only runs correctly with the user's trust.
NEEDS_TRUST_PREFIXES = ("torch.nn.", "torch.ao.nn.", "torch.optim.", "__main__.")

# Names a non-allowlisted callable has when it executes, imports or fetches: DANGEROUS whatever the module
# (torch.utils.collect_env.run, multiprocessing.util.spawnv_passfds, mlflow ... _run_entry_point).
_EXEC_NAME = re.compile(   # matched against lower-case (function) names only
    r"(^|_)(system|popen\w*|spawn\w*|exec\w*|eval\w*|run\w*|call|check_call|check_output|getoutput|"
    r"getstatusoutput|import_module|load_module|load_source|loads?|compile|urlopen|urlretrieve|"
    r"download\w*|fetch\w*|rmtree|remove|unlink|write_file|write_text|write_bytes|startfile)$",
)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class Verdict(Record):
    """How the policy judges one global: a severity, the rule id and why."""

    __slots__ = ("severity", "rule", "detail")
    severity: Severity
    rule: str
    detail: str

    def __init__(self, severity: Severity, rule: str, detail: str) -> None:
        self._set(severity=severity, rule=rule, detail=detail)


def normalize(module: str, name: str) -> tuple[str, str]:
    """Python 2 names mapped to Python 3 ones, as pickle's find_class does for protocols < 3."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def _dotted_ok(text: str) -> bool:
    return bool(text) and all(_IDENT.match(part) for part in text.split("."))


def denied_reason(path: str) -> str | None:
    """The DENIED reason for the longest prefix of the dotted `path`, or None."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        reason = DENIED.get(".".join(parts[:end]))
        if reason is not None:
            return reason
    return None


def classify(module: str, name: str) -> Verdict:
    """How dangerous it is for a pickle to reference `module.name` (it may call it or pass it on)."""
    mapped = normalize(module, name)
    verdict = _classify_one(*mapped)
    if mapped != (module, name):
        # Protocols >= 3 import the raw (Python 2) name, which Python 3 lacks, unless it is also denied.
        raw = _classify_one(module, name)
        if raw.rule == "pickle.global.denied" and raw.severity > verdict.severity:
            return raw
    return verdict


def _classify_one(module: str, name: str) -> Verdict:
    if not (_dotted_ok(module) and _dotted_ok(name)):
        return Verdict(Severity.DANGEROUS, "pickle.global.malformed",
                       f"{module!r} / {name!r} is not a dotted Python name; crafted to confuse parsers")
    reason = ALLOWED.get(module, {}).get(name)
    if reason is not None:
        return Verdict(Severity.SAFE, "pickle.global.allowed", reason)
    if (module == "__torch__" or module.startswith("__torch__.")) and _IDENT.match(name) and "__" not in name:
        # TorchScript class references: the C++ unpickler resolves them only from the archive's own
        # compiled code (judged as torchscript.code); Python's unpickler cannot import `__torch__`.
        return Verdict(Severity.SAFE, "pickle.global.torchscript_class", "a class compiled from the archive's code/")
    path = f"{module}.{name}"
    reason = denied_reason(path)
    if reason is not None:
        return Verdict(Severity.DANGEROUS, "pickle.global.denied", f"{path}: {reason}")
    parts = path.split(".")
    dunder = [p for p in parts if p.startswith("__") and p.endswith("__") and p != "__main__"]
    if dunder:
        return Verdict(Severity.DANGEROUS, "pickle.global.dunder",
                       f"{path} reaches interpreter internals ({dunder[0]}); no checkpoint needs that")
    if "." in name:
        return Verdict(Severity.DANGEROUS, "pickle.global.attribute_path",
                       f"{path} walks attributes ({name}) at load time, which reaches modules imported "
                       "by other modules (posixpath + 'os.system')")
    if parts[0] in ("torch", "numpy") and any(p.startswith("_") for p in parts[1:-1]):
        return Verdict(Severity.DANGEROUS, "pickle.global.private_module",
                       f"{path} is {parts[0]} internals outside the rebuild functions checkpoints use")
    if module.startswith("_") and module != "__main__":
        return Verdict(Severity.DANGEROUS, "pickle.global.private_module",
                       f"{path} comes from a private interpreter module")
    last = name.split(".")[-1]
    if last[:1].islower() and _EXEC_NAME.search(last):
        return Verdict(Severity.DANGEROUS, "pickle.global.exec_like",
                       f"{path} is named like a function that runs, imports, loads or fetches something")
    if path.startswith(NEEDS_TRUST_PREFIXES):
        return Verdict(Severity.SUSPICIOUS, "pickle.module.needs_trust",
                       f"{path}: a whole-module pickle; rebuilding it runs the class's own code, "
                       "so it loads only with --trust (API: trust=True)")
    return Verdict(Severity.SUSPICIOUS, "pickle.global.unknown",
                   f"{path} is not on modelkit's allowlist of what checkpoints need; loading runs its code")


# Rules whose SUSPICIOUS findings mean "runs the file's own code": the gate needs trust=True for them.
NEEDS_TRUST_RULES = frozenset({
    "pickle.module.needs_trust", "pickle.global.unknown", "pickle.build.unusual", "torchscript.code",
    "torchscript.code.custom_op", "keras.config.custom_object", "keras.config.op_lambda",
    "joblib.object", "code.python_source", "torchscript.code.exception_class", "pt2.custom_op", "pt2.custom_object",
    "pt2.opaque_object", "pt2.target.unknown",
})
