"""Format dispatch by content (never by extension) and the container formats: zip, tar, npy, compressed pickles.

`scan_buffer` looks at the first bytes of a file or archive member and hands it to the analysis for
what it is; containers call it again on their members, up to `MAX_NESTING` levels. Tensor data is
never read: torch storages are skipped by name (from the pickle's persistent ids), and header-only
formats are checked against the file size. Standard library only.
"""
from __future__ import annotations

import io
import re
import struct
import zlib
from collections.abc import Callable

from modelkit.errors import ParseError
from modelkit.parse import zipdir
from modelkit.parse.paths import member_problem
from modelkit.parse.pickle import looks_like_pickle
from modelkit.parse.sniff import COMPRESSED, sniff, unsupported_archive
from modelkit.scan.model import Finding, Severity
from modelkit.scan.pickle import (
    Limits,
    PickleResult,
    Sink,
    StreamResult,
    probe_pickle,
    walk,
    walk_stream,
)

MAX_NESTING = 3                      # archives inside archives
MAX_MEMBERS = 200_000
MAX_MEMBER_BYTES = 1 << 30           # one member read into memory (pickles, configs); more is a limit finding
MAX_TOTAL_READ = 4 << 30             # all members of one file
BOMB_RATIO = 200                     # uncompressed / compressed, with...
BOMB_MIN_BYTES = 64 << 20            # ...at least this much declared output
_HEAD = 16


class ScanFailure(Exception):
    """The file cannot be scanned at all (unrecognised content): reported as an error, never as clean."""


class Context:
    """What every analysis of one top-level file shares.

    Args:
        display: The file's name in findings.
        directory: Its folder (absolute, symlinks resolved), for ONNX external data; None for none.
        limits: Per-pickle bounds.
        deadline: time.monotonic() value after which walks stop with a limit finding.
    """

    __slots__ = ("display", "directory", "limits", "deadline", "findings", "examined", "depth", "read_total",
                 "data_files")

    def __init__(self, *, display: str, directory: str | None, limits: Limits, deadline: float) -> None:
        self.display = display
        self.directory = directory
        self.limits = limits
        self.deadline = deadline
        self.findings: list[Finding] = []
        self.examined: list[str] = []
        self.depth = 0                # archives inside archives, now
        self.read_total = 0           # member bytes read so far
        self.data_files: list[str] = []   # raw tensor-data files the model names (real paths): TF.js shards, ONNX external data

    def sink(self, label: str, base: int = 0) -> Sink:
        return Sink(label, base, self.findings)

    def trailing(self, buf, pos: int, end: int, label: str, *, base: int = 0) -> None:
        """Analyse bytes after a complete file (see `trailing`); header analysers call this, so they
        need not import this module."""
        trailing(buf, pos, end, self, label, base=base)


# ---------------------------------------------------------------------------------------------
# Dispatch.

def scan_buffer(buf, start: int, end: int, ctx: Context, label: str, *, hint: str = "") -> str:
    """Analyse buf[start:end] (a file or a member) as whatever its content is; returns the format name."""
    fmt = None
    if hint == "fingerprint.pb":       # a SavedModel's hashes; shaped like the start of an ONNX model
        from modelkit.parse.savedmodel import fingerprint
        fmt = "savedmodel fingerprint" if fingerprint(buf, start, end) else None
    elif hint == "keras_metadata.pb":  # a Keras 2 SavedModel's layer configs: judged like every Keras config
        fmt = "keras metadata"
    fmt = fmt or sniff(buf, start, end)
    if fmt is None:
        unsupported = unsupported_archive(bytes(buf[start:start + 16]))
        if unsupported is not None:
            ctx.sink(label, start).add(Severity.DANGEROUS, "archive.unsupported",
                                       f"a {unsupported} archive, which the scanner cannot open: what it holds was not "
                                       "examined, and a loader that unpacks it sees content nobody checked",
                                       offset=start, name=unsupported)
            return unsupported
        fmt = _sniff_text(buf, start, end, ctx, label, hint)
    handler = _HANDLERS.get(fmt)
    if handler is not None:
        return handler(buf, start, end, ctx, label) or fmt   # a handler may name the format more exactly
    return fmt


def _scan_template(buf, start: int, end: int, ctx: Context, label: str) -> str:
    """A chat template kept in a file of its own: the check GGUF and tokenizer_config.json templates get."""
    from modelkit.scan import headers

    try:
        template = bytes(buf[start:end]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ScanFailure("a .jinja chat template that is not UTF-8 text") from e
    headers.check_template(template, "chat_template", ctx, label)
    ctx.examined.append(f"{label}: chat template")
    return "chat template"


def _sniff_text(buf, start: int, end: int, ctx: Context, label: str, hint: str) -> str:
    """Protocol 0/1 pickles, JSON, Python source and text; anything else cannot be scanned."""
    probe = Sink(label, start)
    result = walk(buf, start, end, probe, ctx.limits, deadline=ctx.deadline)
    # A walk that resolved a real global (valid names), or reached STOP, is a pickle whatever else it
    # looks like: the unpickler would have imported that global before failing.
    if result.complete or result.globals:
        _scan_pickle(buf, start, end, ctx, label)
        return "pickle"
    if end - start == 0:
        raise ScanFailure("empty file: nothing to scan")
    head = bytes(buf[start:start + 4096])
    try:
        if b"\x00" in head:
            raise UnicodeDecodeError("utf-8", head, head.index(b"\x00"), head.index(b"\x00") + 1, "NUL byte")
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if len(head) < 4096 or e.start < len(head) - 4:
            raise ScanFailure("unrecognised content: not a model format modelkit can scan") from e
    stripped = head.lstrip()
    if hint.endswith(".jinja"):         # a Hugging Face folder's chat_template.jinja: Jinja, often starting with "{%"
        return _scan_template(buf, start, end, ctx, label)
    if stripped[:1] == b"<":
        from modelkit.parse.openvino import looks_like_ir
        if looks_like_ir(head):
            from modelkit.scan import openvino
            return openvino.scan_ir(buf, start, end, ctx, label)
    if stripped[:1] in (b"{", b"["):
        from modelkit.scan import keras
        return keras.scan_json(buf, start, end, ctx, label)
    if hint.endswith(".py"):
        ctx.sink(label).add(Severity.SUSPICIOUS, "code.python_source",
                            "Python source shipped with a model runs when a loader trusts remote code")
        return "python"
    if ctx.depth == 0:
        ctx.examined.append(f"{label}: text")
    return "text"


def _scan_pickle(buf, start: int, end: int, ctx: Context, label: str, *, note: bool = True) -> StreamResult:
    stream = walk_stream(buf, start, end, ctx.sink(label, start), ctx.limits, deadline=ctx.deadline)
    kind = "legacy torch.save stream" if stream.legacy_torch else "pickle stream"
    ops = sum(p.opcodes for p in stream.pickles)
    if note:
        ctx.examined.append(f"{label}: {kind}, {len(stream.pickles)} pickle(s), {ops} opcodes")
    if stream.trailing is not None:
        trailing(buf, stream.trailing, end, ctx, label, base=start)
    return stream


# ---------------------------------------------------------------------------------------------
# npy: a header, then raw data, or a pickle when the dtype holds Python objects.

def _scan_npy(buf, start: int, end: int, ctx: Context, label: str) -> None:
    from modelkit.parse import npy  # here: only .npy content needs it (start-up time)

    sink = ctx.sink(label, start)
    try:
        header = npy.read_header(buf, start, end)
    except ParseError as e:
        sink.add(Severity.DANGEROUS, "npy.header.malformed", e.reason, offset=start)
        return
    data, shape = header.data_start, header.shape
    if header.has_object:
        sink.add(Severity.SUSPICIOUS, "npy.object_dtype",
                 "object dtype: the data is a pickle, loaded only with allow_pickle=True", offset=data)
        _scan_pickle(buf, data, end, ctx, label)
        ctx.examined.append(f"{label}: .npy header (object dtype, shape {shape})")
        return
    ctx.examined.append(f"{label}: .npy header ({header.descr}, shape {shape})")
    if header.itemsize is None:
        return
    expected = data + header.numel * header.itemsize
    if expected > end:
        sink.add(Severity.DANGEROUS, "npy.header.size_mismatch",
                 f"header claims {header.numel * header.itemsize} data bytes, the file has {end - data}", offset=start)
    elif expected < end:
        trailing(buf, expected, end, ctx, label)


# ---------------------------------------------------------------------------------------------
# Trailing data and polyglots.

def trailing(buf, pos: int, end: int, ctx: Context, label: str, *, base: int = 0) -> None:
    """Bytes after a complete file: another format hidden there is a polyglot (DANGEROUS)."""
    sink = ctx.sink(label, base)
    inner = sniff(buf, pos, end)
    if inner is None and buf.find(b"PK\x05\x06", pos, end) >= 0:
        inner = "zip"
    if inner is None and probe_pickle(buf, pos, end, sink, ctx.limits, ctx.deadline):
        sink.add(Severity.DANGEROUS, "polyglot.appended",
                 "a second pickle follows the end of the first; a loader that reads on runs it", offset=pos)
        return
    if inner is None:
        sink.add(Severity.SUSPICIOUS, "container.trailing_data",
                 f"{end - pos} bytes follow the end of the file's content; no reader needs them", offset=pos)
        return
    sink.add(Severity.DANGEROUS, "polyglot.appended",
             f"a {inner} follows the end of the file's content: one file, two readings", offset=pos)
    if ctx.depth < MAX_NESTING:
        ctx.depth += 1
        try:
            scan_buffer(buf, pos, end, ctx, f"{label}@{pos}")
        except ScanFailure:
            pass
        finally:
            ctx.depth -= 1


# ---------------------------------------------------------------------------------------------
# Zip: torch checkpoints, TorchScript, npz, .keras. Names, sizes and local headers are checked
# before anything is read; members are read from the raw bytes, ignoring flag bits (as torch does).

def _read_member(buf, data: int, info: zipdir.ZipEntry, limit: int) -> bytes:
    """Up to `limit` bytes of the member, decompressed; raises ValueError for what cannot be read."""
    raw = buf[data:data + info.compress_size]
    if info.compress_type == zipdir.STORED:
        return bytes(raw[:limit])
    if info.compress_type == zipdir.DEFLATED:
        d = zlib.decompressobj(-15)
        try:
            return d.decompress(bytes(raw), limit)
        except zlib.error as e:
            raise ValueError(f"corrupt deflate data ({e})") from e
    if info.compress_type in (zipdir.BZIP2, zipdir.LZMA):
        return _bounded_decompress(bytes(raw), "bzip2" if info.compress_type == zipdir.BZIP2 else "zip-lzma", limit)
    raise ValueError(f"compression method {info.compress_type} is not supported")


def _scan_zip(buf, start: int, end: int, ctx: Context, label: str) -> str | None:
    from modelkit.parse import keras as keras_config  # here: only zips need them (start-up time of `modelkit scan`)
    from modelkit.parse import npz
    from modelkit.parse import pt2 as pt2_archive

    sink = ctx.sink(label, start)
    view = buf if start == 0 and end == len(buf) else bytes(buf[start:end])
    try:
        infos = zipdir.read_directory(view, max_entries=MAX_MEMBERS)
    except ParseError as e:
        sink.add(Severity.DANGEROUS, "zip.malformed", f"the zip directory cannot be parsed ({e.reason}); loaders may "
                 "read it differently than scanners", offset=start)
        return None
    base_buf = view
    if len(infos) > MAX_MEMBERS:
        sink.add(Severity.DANGEROUS, "scan.limit.members", f"{len(infos)} members; more than {MAX_MEMBERS}")
        infos = infos[:MAX_MEMBERS]
    names = [i.filename for i in infos]
    roots = {n.split("/", 1)[0] for n in names if n.endswith("data.pkl") and n.count("/") == 1}
    is_torchscript = any("/code/" in n or n.startswith("code/") for n in names) and any(
        n.endswith("constants.pkl") for n in names)
    pt2_root = pt2_archive.root_of(names)       # judged as PT2 even beside a data.pkl: torch.export.load reads it so
    layout = None
    if pt2_root is not None:
        from modelkit.scan import pt2
        layout = pt2.Layout(pt2_root)
    kind = "TorchScript archive" if is_torchscript else "torch zip checkpoint" if roots else (
        "PT2 archive" if layout is not None else
        "npz archive" if npz.is_npz(names) else
        "Keras archive" if keras_config.is_archive(names) else "zip archive")
    seen: set[str] = set()
    storages: set[str] = set()
    declared = 0
    # Pickles first: their persistent ids name the storage members that are then skipped unread. A PT2
    # archive's JSON configs come before them: they name its raw tensor members.
    order = sorted(infos, key=lambda i: (pt2.sort_key(i.filename, pt2_root) if layout is not None else 0,
                                         not i.filename.endswith(".pkl"), i.filename))
    counts = {"pickles": 0, "storages": 0, "code": 0, "other": 0}
    for info in order:
        name = info.filename
        member = f"{label}:{name}"
        problem = member_problem(name)
        if problem:
            sink.add(Severity.DANGEROUS, "zip.path_traversal", f"member {name!r} {problem}", module="", name=name)
        if name in seen:
            sink.add(Severity.DANGEROUS, "zip.duplicate_member",
                     f"{name!r} appears twice; torch and Python's zipfile pick different copies", name=name)
        seen.add(name)
        if (info.external_attr >> 16) & 0o170000 == 0o120000:
            sink.add(Severity.SUSPICIOUS, "zip.symlink", f"member {name!r} is a symbolic link", name=name)
        declared += info.file_size
        if info.file_size > BOMB_MIN_BYTES and info.file_size > BOMB_RATIO * max(info.compress_size, 1):
            sink.add(Severity.DANGEROUS, "zip.bomb", f"{name!r} expands {info.compress_size} bytes to "
                     f"{info.file_size} (ratio {info.file_size // max(info.compress_size, 1)})", name=name)
            continue
        if info.flag_bits & 0x1:
            sink.add(Severity.SUSPICIOUS, "zip.encrypted_flag",
                     f"{name!r} has the encryption flag, which torch ignores and zipfile refuses", name=name)
        if name.endswith("/"):
            continue
        try:
            data = zipdir.member_data(base_buf, info)
        except ParseError as e:
            sink.add(Severity.DANGEROUS, "zip.header_mismatch", f"{name!r}: {e.reason}", name=name)
            continue
        if _is_storage(name, roots, storages) or (layout is not None and layout.is_raw(name)) or (
                kind == "Keras archive" and _keras_weights(base_buf, info)):
            counts["storages"] += 1
            continue
        limit = min(info.file_size, MAX_MEMBER_BYTES)
        if ctx.read_total + limit > MAX_TOTAL_READ:
            sink.add(Severity.DANGEROUS, "scan.limit.bytes", f"more than {MAX_TOTAL_READ} bytes of members to read")
            break
        try:
            content = _read_member(base_buf, data, info, limit + 1)
        except (ValueError, OSError, EOFError, MemoryError, _lzma_error()) as e:
            # What the scanner cannot read, a loader with another decompressor may: its content is unknown.
            sink.add(Severity.DANGEROUS, "zip.unreadable_member", f"{name!r} cannot be read ({e}); its content was "
                     "not examined", name=name)
            continue
        ctx.read_total += len(content)
        if len(content) > info.file_size:
            sink.add(Severity.DANGEROUS, "zip.size_mismatch",
                     f"{name!r} expands past its declared size {info.file_size}", name=name)
            content = content[:info.file_size]
        if info.file_size > MAX_MEMBER_BYTES:
            sink.add(Severity.DANGEROUS, "scan.limit.bytes", f"{name!r} is larger than {MAX_MEMBER_BYTES} bytes; "
                     "only its start was examined", name=name)
        judged = pt2.scan_member(content, name, member, ctx, layout) if layout is not None else None
        counts[judged or _scan_member(content, name, member, ctx, roots, storages, is_torchscript, kind, layout)] += 1
    if declared > BOMB_MIN_BYTES * 1024:
        sink.add(Severity.DANGEROUS, "zip.bomb", f"members declare {declared} bytes in all")
    if is_torchscript:
        from modelkit.scan import torchscript
        torchscript.trust_finding(ctx.sink(label), counts["code"])
    ctx.examined.append(f"{label}: {kind}, {len(infos)} members ({counts['pickles']} pickles, "
                        f"{counts['storages']} tensor storages skipped unread, {counts['code']} code files)")
    return _ZIP_FORMATS[kind]


_ZIP_FORMATS = {"TorchScript archive": "torchscript", "torch zip checkpoint": "pth", "npz archive": "npz",
                "Keras archive": "keras", "PT2 archive": "pt2", "zip archive": "zip"}

# Compiled code by its first bytes: ELF, Mach-O (both byte orders, 32/64-bit, fat) and PE (MZ ... "PE\0\0").
_NATIVE = ((b"\x7fELF", "an ELF shared library or executable"), (b"\xcf\xfa\xed\xfe", "a Mach-O library"),
           (b"\xce\xfa\xed\xfe", "a Mach-O library"), (b"\xfe\xed\xfa\xcf", "a Mach-O library"),
           (b"\xfe\xed\xfa\xce", "a Mach-O library"), (b"\xca\xfe\xba\xbe", "a Mach-O universal library"))
_NATIVE_SUFFIXES = (".so", ".dll", ".dylib", ".pyd")


def native_code(content: bytes, name: str) -> str | None:
    """What compiled code `content` is, or None: an archive member no model format needs."""
    for magic, what in _NATIVE:
        if content.startswith(magic):
            return what
    if content.startswith(b"MZ") and len(content) >= 64:
        pe = struct.unpack_from("<I", content, 0x3C)[0]
        if content[pe:pe + 4] == b"PE\0\0":
            return "a Windows executable or DLL"
    if name.lower().endswith(_NATIVE_SUFFIXES) or ".so." in name.rsplit("/", 1)[-1]:
        return "named like a shared library"
    return None


def _keras_weights(buf, info: zipdir.ZipEntry) -> bool:
    """A .keras archive's model.weights.h5 that is an HDF5 file: tensor data Keras reads with h5py, which runs
    nothing (the archive's code, Lambda layers and custom objects, is in config.json). Skipped unread but for
    its superblock, as torch storages are: a large model's weights are not read twice (nor refused for size)."""
    from modelkit.parse import hdf5, keras

    if info.filename != keras.ARCHIVE_WEIGHTS:
        return False
    try:
        return hdf5.plausible_superblock(zipdir.read_start(buf, info, hdf5.SUPERBLOCK_HEAD))
    except ParseError:
        return False


def _is_storage(name: str, roots: set[str], storages: set[str]) -> bool:
    parts = name.split("/")
    if len(parts) == 3 and parts[0] in roots and parts[1] in ("data", "constants"):
        return f"{parts[0]}/{parts[1]}/{parts[2]}" in storages
    return False


# Small text records torch writes beside data.pkl and reads as text (never unpickles): "little",
# "3", a serialization id. Matching ones are skipped instead of being walked as protocol-0 pickles.
_TORCH_TEXT_RECORDS = frozenset({"byteorder", "version", ".format_version", ".storage_alignment", ".data/version",
                                 ".data/serialization_id"})
_TEXT_RECORD = re.compile(rb"(?:little|big|[0-9a-fA-F]{0,64})\s*")


def _torch_text_record(content: bytes, name: str, root: str, roots: set[str]) -> bool:
    return (root in roots and name[len(root) + 1:] in _TORCH_TEXT_RECORDS and len(content) <= 80
            and _TEXT_RECORD.fullmatch(content) is not None)


def _scan_member(content: bytes, name: str, member: str, ctx: Context, roots: set[str], storages: set[str],
                 is_torchscript: bool, kind: str, layout=None) -> str:
    root = name.split("/", 1)[0]
    if _torch_text_record(content, name, root, roots):
        return "other"
    native = native_code(content, name)
    if native is not None:
        ctx.sink(member).add(Severity.DANGEROUS, "archive.native_code",
                             f"{name!r} is {native}: a loader that extracts the archive may load and run it", name=name)
        return "code"
    if name.endswith((".pkl", ".debug_pkl")) or looks_like_pickle(content[:2]):
        stream = _scan_pickle(content, 0, len(content), ctx, member, note=not name.endswith(".debug_pkl"))
        if root in roots and stream.pickles:
            folder = "constants" if name.endswith("constants.pkl") else "data"
            storages.update(f"{root}/{folder}/{key}" for key in _storage_keys(stream.pickles[0]))
        return "pickles"
    if is_torchscript and "/code/" in f"/{name}" and name.endswith(".py"):
        from modelkit.scan import torchscript
        torchscript.scan_code(content, ctx.sink(member), ctx.limits)
        return "code"
    if kind == "Keras archive" and name == "config.json":
        from modelkit.scan import keras
        keras.scan_json(content, 0, len(content), ctx, member, keras_archive=True)
        return "other"
    fmt = sniff(content, 0, len(content))
    if fmt in ("zip", "tar", "gzip", "bzip2", "xz", "lzma", "zlib") and not (layout is not None and layout.nested_ok(name)):
        ctx.sink(member).add(Severity.SUSPICIOUS, "zip.nested_archive",
                             f"an archive ({fmt}) inside an archive; scanned to depth {MAX_NESTING}")
    if ctx.depth >= MAX_NESTING:
        ctx.sink(member).add(Severity.DANGEROUS, "scan.limit.nesting", f"archives nested deeper than {MAX_NESTING}")
        return "other"
    ctx.depth += 1
    try:
        scan_buffer(content, 0, len(content), ctx, member, hint=name)
    except ScanFailure:
        if name.startswith(tuple(f"{r}/" for r in roots)) or kind != "zip archive":
            pass   # opaque records inside a known container (tensor bytes, metadata)
        else:
            ctx.sink(member).add(Severity.SUSPICIOUS, "zip.unknown_member", f"{name!r} is not a format modelkit knows")
    finally:
        ctx.depth -= 1
    return "other"


def _storage_keys(result: PickleResult) -> list[str]:
    keys = []
    for pid in result.persistent_ids:
        if isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage" and isinstance(pid[2], str):
            keys.append(pid[2])
    return keys


# ---------------------------------------------------------------------------------------------
# tar (the oldest torch.save format, and model bundles) and compressed streams (joblib).

def _scan_tar(buf, start: int, end: int, ctx: Context, label: str) -> None:
    import tarfile
    sink = ctx.sink(label, start)
    count = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(bytes(buf[start:end])), mode="r:") as tar:
            for member in tar:
                count += 1
                if count > MAX_MEMBERS:
                    sink.add(Severity.DANGEROUS, "scan.limit.members", f"more than {MAX_MEMBERS} members")
                    break
                problem = member_problem(member.name)
                if problem:
                    sink.add(Severity.DANGEROUS, "tar.path_traversal", f"member {member.name!r} {problem}",
                             name=member.name)
                if member.issym() or member.islnk():
                    target = member.linkname
                    severity = Severity.DANGEROUS if member_problem(target) else Severity.SUSPICIOUS
                    sink.add(severity, "tar.link", f"{member.name!r} links to {target!r}", name=member.name)
                    continue
                if not member.isfile() or member.size == 0:
                    continue
                handle = tar.extractfile(member)
                content = handle.read(MAX_MEMBER_BYTES) if handle else b""
                if ctx.depth >= MAX_NESTING:
                    sink.add(Severity.DANGEROUS, "scan.limit.nesting", f"archives nested deeper than {MAX_NESTING}")
                    break
                ctx.depth += 1
                try:
                    scan_buffer(content, 0, len(content), ctx, f"{label}:{member.name}", hint=member.name)
                except ScanFailure:
                    pass   # raw storage bytes in old torch tar checkpoints
                finally:
                    ctx.depth -= 1
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        sink.add(Severity.SUSPICIOUS, "tar.malformed", f"the tar archive cannot be read ({e})")
    ctx.examined.append(f"{label}: tar archive, {count} members")


def _bounded_decompress(raw: bytes, codec: str, limit: int) -> bytes:
    import bz2
    import lzma
    if codec == "zlib":
        return zlib.decompressobj().decompress(raw, limit)
    if codec == "gzip":
        return zlib.decompressobj(16 + 15).decompress(raw, limit)
    if codec == "bzip2":
        return bz2.BZ2Decompressor().decompress(raw, limit)
    if codec == "zip-lzma":   # zip's LZMA: 2-byte version, 2-byte properties size, properties, raw stream
        psize = struct.unpack_from("<H", raw, 2)[0]
        filters = [lzma._decode_filter_properties(lzma.FILTER_LZMA1, raw[4:4 + psize])]
        return lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=filters).decompress(raw[4 + psize:], limit)
    fmt = lzma.FORMAT_XZ if codec == "xz" else lzma.FORMAT_ALONE
    return lzma.LZMADecompressor(fmt).decompress(raw, limit)


def _scan_compressed(codec: str) -> Callable[..., None]:
    def scan(buf, start: int, end: int, ctx: Context, label: str) -> None:
        sink = ctx.sink(label, start)
        raw = bytes(buf[start:end])
        try:
            content = _bounded_decompress(raw, codec, MAX_MEMBER_BYTES + 1)
        except (OSError, EOFError, ValueError, zlib.error, MemoryError, struct.error, _lzma_error()) as e:
            sink.add(Severity.SUSPICIOUS, "compressed.malformed", f"{codec} data cannot be decompressed ({e})")
            return
        if len(content) > MAX_MEMBER_BYTES or len(content) > BOMB_RATIO * len(raw) > BOMB_MIN_BYTES:
            sink.add(Severity.DANGEROUS, "compressed.bomb",
                     f"{codec} data expands {len(raw)} bytes to more than {len(content)}; not examined further")
            return
        ctx.examined.append(f"{label}: {codec}-compressed, {len(content)} bytes inside")
        if ctx.depth >= MAX_NESTING:
            sink.add(Severity.DANGEROUS, "scan.limit.nesting", f"compressed layers nested deeper than {MAX_NESTING}")
            return
        ctx.depth += 1
        try:
            scan_buffer(content, 0, len(content), ctx, f"{label}[{codec}]")
        finally:
            ctx.depth -= 1
    return scan


def _lzma_error() -> type[Exception]:
    import lzma
    return lzma.LZMAError


def _lazy(module: str, function: str) -> Callable[..., str | None]:
    """A handler in another scan module, imported the first time a file needs it (keeps startup short)."""
    def handler(*args):
        import importlib
        return getattr(importlib.import_module(f"modelkit.scan.{module}"), function)(*args)
    return handler


_HANDLERS: dict[str, Callable[..., None]] = {
    "zip": _scan_zip, "pickle": lambda *args: "pth" if _scan_pickle(*args).legacy_torch else "pickle", "npy": _scan_npy, "tar": _scan_tar,
    "safetensors": _lazy("headers", "scan_safetensors"), "gguf": _lazy("headers", "scan_gguf"),
    "ggml": _lazy("headers", "scan_ggml"),
    "hdf5": _lazy("keras", "scan_hdf5"), "onnx": _lazy("onnx", "scan_onnx"),
    "savedmodel": _lazy("tensorflow", "scan_savedmodel"), "tf-checkpoint": _lazy("tensorflow", "scan_index"),
    "savedmodel fingerprint": _lazy("tensorflow", "scan_fingerprint"),
    "keras metadata": _lazy("tensorflow", "scan_keras_metadata_file"),
    **{codec: _scan_compressed(codec) for _, codec in COMPRESSED},
}


def polyglot_zip(buf, fmt: str, ctx: Context, label: str) -> None:
    """A file that is not a zip by its first bytes but has a zip directory at its end: two readings."""
    if bytes(buf[:4]) in (b"PK\x03\x04", b"PK\x05\x06") or not zipdir.has_directory(buf):
        return
    ctx.sink(label).add(Severity.DANGEROUS, "polyglot.zip",
                        f"the file reads as {fmt} from its start and as a zip archive from its end; "
                        "loaders that check differently see different content")
