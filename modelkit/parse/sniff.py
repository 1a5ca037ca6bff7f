"""What content is, from its first bytes: the scanner's dispatch (`sniff`), a phrase for messages
about files modelkit cannot read (`describe`), and torch.save zips told from TorchScript archives by
their member names (`torch_zip_roots`).

Standard library only, and light to import (the scanner starts with it); reads at most a header.
"""
from __future__ import annotations

import os
import struct

from modelkit.parse.pickle_opcodes import looks_like_pickle

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from collections.abc import Iterator

HEAD_BYTES = 4096
TF_TABLE_MAGIC = (0xDB4775248B80FB57).to_bytes(8, "little")   # parse.tf_bundle.TABLE_MAGIC: a checkpoint .index
COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x5d\x00\x00", "lzma"),
              (b"\x78\x01", "zlib"), (b"\x78\x5e", "zlib"), (b"\x78\x9c", "zlib"), (b"\x78\xda", "zlib"))


def sniff(buf, start: int, end: int) -> str | None:
    """The format name for content at buf[start:end], from its first bytes; None if not recognised.

    Generous on purpose (the scanner must look at anything a loader might accept): a safetensors
    length that does not fit the file still names safetensors, so the scanner reports it.
    """
    head = bytes(buf[start:start + 512])
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "zip"
    if looks_like_pickle(head):
        return "pickle"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head.startswith(b"GGUF"):                       # parse.gguf.MAGIC (not imported: start-up time)
        return "gguf"
    if head.startswith(b"\x89HDF\r\n\x1a\n"):          # parse.hdf5.SIGNATURE
        return "hdf5"
    if head[:4] in (b"lmgg", b"fmgg", b"tjgg"):        # parse.ggml.MAGICS, little-endian: legacy llama.cpp files
        return "ggml"
    if len(head) >= 9 and head[8:9] == b"{" and struct.unpack_from("<Q", head)[0] > 0:
        return "safetensors"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    for magic, name in COMPRESSED:
        if head.startswith(magic):
            return name
    if head[:1] == b"\x08":
        from modelkit.parse.onnx import looks_like_model  # here: only files starting like a protobuf need it
        if looks_like_model(buf, start, end):
            return "onnx"
        from modelkit.parse.savedmodel import looks_like
        if looks_like(buf, start, end):
            return "savedmodel"
    if end - start >= 48 and bytes(buf[end - 8:end]) == TF_TABLE_MAGIC:
        return "tf-checkpoint"
    return None

# Archives and compressed streams the scanner cannot open (no standard-library reader): what they hold is
# unknown, so a file or member that is one is never judged from the outside. (prefix, name)
UNSUPPORTED_ARCHIVES = ((b"7z\xbc\xaf\x27\x1c", "7z"), (b"Rar!\x1a\x07", "rar"), (b"\x28\xb5\x2f\xfd", "zstd"),
                        (b"\x04\x22\x4d\x18", "lz4"), (b"MSCF\x00\x00\x00\x00", "cab"), (b"xar!", "xar"),
                        (b"!<arch>\n", "ar"), (b"070701", "cpio"), (b"070707", "cpio"), (b"hsqs", "squashfs"),
                        (b"\xff\x06\x00\x00sNaPpY", "snappy"), (b"\x89LZO\x00", "lzop"))


def unsupported_archive(head: bytes) -> str | None:
    """The name of an archive format the scanner cannot open that `head` starts with, or None."""
    return next((name for magic, name in UNSUPPORTED_ARCHIVES if head.startswith(magic)), None)


# (prefix, description), most specific first.
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"GGUF", "a GGUF file"),
    (b"tjgg", "a legacy llama.cpp file (ggjt)"),
    (b"lmgg", "a legacy llama.cpp file (ggml)"),
    (b"fmgg", "a legacy llama.cpp file (ggmf)"),
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


def read_head(path: str | os.PathLike[str], size: int = HEAD_BYTES) -> bytes:
    """The first `size` bytes of a file."""
    with open(path, "rb") as f:
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
    if head[:3] == b"\x08\x01\x12":
        return "a protobuf message (possibly a TensorFlow SavedModel)"
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
