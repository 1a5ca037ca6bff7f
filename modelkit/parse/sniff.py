"""Name what a file looks like from its first bytes, for messages about files modelkit cannot read;
and tell torch.save zips from TorchScript archives by their member names.

Standard library only (the scanner uses it too); reads at most `HEAD_BYTES` and never parses.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

HEAD_BYTES = 4096

# (prefix, description), most specific first.
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"GGUF", "a GGUF file"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file"),
    (b"PK\x03\x04", "a zip archive (torch.save, TorchScript, .keras or .npz)"),
    (b"PK\x05\x06", "an empty zip archive"),
    (b"\x93NUMPY", "a numpy .npy array"),
    (b"\x1f\x8b", "gzip-compressed data"),
    (b"BZh", "bzip2-compressed data"),
    (b"\xfd7zXZ\x00", "xz-compressed data"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data"),
    (b"\x7fELF", "an ELF executable"),
    (b"MZ", "a Windows executable"),
    (b"\x89PNG", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
)


def read_head(path: Path, size: int = HEAD_BYTES) -> bytes:
    with path.open("rb") as f:
        return f.read(size)


def describe(head: bytes) -> str:
    """A short phrase for what `head` (a file's first bytes) looks like."""
    if not head:
        return "an empty file"
    for prefix, what in _MAGIC:
        if head.startswith(prefix):
            return what
    if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:
        return f"a pickle (protocol {head[1]}), as written by torch.save's legacy format or pickle.dump"
    if len(head) >= 265 and head[257:262] == b"ustar":
        return "a tar archive"
    if len(head) >= 9 and head[8:9] == b"{":
        return "a safetensors-like header (8-byte length, then JSON)"
    if head[:1] == b"\x08":
        return "a protobuf message (possibly ONNX)"
    stripped = head.lstrip()
    if stripped[:1] in (b"{", b"["):
        return "JSON text"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return f"binary data starting with {head[:8]!r}"
    return "text"


def torch_zip_roots(names: list[str]) -> Iterator[tuple[str, bool, bool]]:
    """For each folder holding data.pkl in a zip's member names, in order: (folder, has
    constants.pkl, has code/). torch.save writes data.pkl alone; torch.jit.save all three."""
    for name in names:
        prefix, _, rest = name.partition("/")
        if rest == "data.pkl":
            yield (prefix, f"{prefix}/constants.pkl" in names,
                   any(n.startswith(f"{prefix}/code/") for n in names))
