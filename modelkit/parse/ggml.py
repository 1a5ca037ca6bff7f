"""Legacy llama.cpp model files (before GGUF, 2023): 'ggml', 'ggmf' and 'ggjt' v1-v3, the llama family.

Layout (little-endian; the definition is llama.cpp's pre-GGUF loader, retold by its
convert_llama_ggml_to_gguf.py):

    u32 magic           0x67676d6c 'ggml' (unversioned) | 0x67676d66 'ggmf' | 0x67676a74 'ggjt'
    u32 version         ggmf: 1; ggjt: 1, 2 or 3 (absent for 'ggml')
    7 x u32 hparams     n_vocab, n_embd, n_mult, n_head, n_layer, n_rot, ftype
    n_vocab x token     u32 length | bytes | f32 score (no score in 'ggml')
    tensors to EOF      u32 n_dims | u32 name length | u32 ggml type | n_dims x u32 ne (fastest first) |
                        name | ggjt only: zero padding to a multiple of 32 from the file's start | data

Block types: F32, F16, and 32-value blocks Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 whose scales are f16 since
ggjt v3 (the layout GGUF kept) and f32 before it (Q4_0 20 bytes, Q4_1 24, Q8_0 36); ggjt v3 files may
also hold the K-quants (256-value super-blocks). ggjt v1 -> v2 changed the Q4 nibble order too, so blocks
of files older than ggjt v3 are not GGUF's blocks.

Every count and length is checked against the file size before anything is sliced. Standard library only.
"""
from __future__ import annotations

import struct
from collections import namedtuple

from modelkit.errors import ParseError

MAGICS = {0x67676D6C: "ggml", 0x67676D66: "ggmf", 0x67676A74: "ggjt"}
VERSIONS = {"ggml": (None,), "ggmf": (1,), "ggjt": (1, 2, 3)}
ALIGNMENT = 32
MAX_VOCAB = 10_000_000
MAX_TOKEN_BYTES = 4096            # as llama.cpp's converter refuses longer ones
MAX_NAME_BYTES = 4096
MAX_DIMS = 4
MAX_TENSORS = 1_000_000
HPARAMS = ("n_vocab", "n_embd", "n_mult", "n_head", "n_layer", "n_rot", "ftype")

# ggml type -> (name, values per block, bytes per block) in ggjt v3 files (GGUF's sizes).
TYPES_V3 = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
            7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
            12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
# ...and before ggjt v3: f32 scales (Q5 as ggjt v2 had them).
TYPES_OLD = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 20), 3: ("Q4_1", 32, 24), 6: ("Q5_0", 32, 24),
             7: ("Q5_1", 32, 28), 8: ("Q8_0", 32, 36)}


# Records are named tuples, not dataclasses: the scanner imports this module, and dataclasses' import is slow.
class Tensor(namedtuple("Tensor", "name type_code type_name ne offset nbytes")):
    """A tensor record: ne in GGML order (ne[0] varies fastest), its data's offset and size."""

    __slots__ = ()

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order (rows first)."""
        return self.ne[::-1]


class GgmlFile(namedtuple("GgmlFile", "kind version hparams tokens scores tensors")):
    """kind "ggml", "ggmf" or "ggjt"; version (None for ggml); the hyperparameters; tokens and scores; tensors."""

    __slots__ = ()

    @property
    def label(self) -> str:
        return self.kind if self.version is None else f"{self.kind} v{self.version}"

    @property
    def blocks_like_gguf(self) -> bool:
        """Whether its quantized blocks are laid out as GGUF's (ggjt v3)."""
        return self.kind == "ggjt" and self.version == 3


def magic(head: bytes) -> str | None:
    """'ggml', 'ggmf' or 'ggjt' for a file starting with that magic (and a known version), else None."""
    if len(head) < 4:
        return None
    kind = MAGICS.get(struct.unpack_from("<I", head)[0])
    if kind is None or kind == "ggml":
        return kind
    if len(head) < 8:
        return None
    return kind if struct.unpack_from("<I", head, 4)[0] in VERSIONS[kind] else None


def _u32s(buf, pos: int, end: int, count: int, what: str) -> tuple[tuple[int, ...], int]:
    if 4 * count > end - pos:
        raise ParseError(f"{what} needs {4 * count} bytes, {max(end - pos, 0)} remain", offset=pos)
    return struct.unpack_from(f"<{count}I", buf, pos), pos + 4 * count


def read(buf, end: int | None = None) -> GgmlFile:
    """The header, vocabulary and tensor records of a legacy file in buf[:end] (tensor data is not read).

    Raises:
        ParseError: an unknown magic or version, or a count, length or tensor that does not fit the file.
    """
    end = len(buf) if end is None else end
    (code,), pos = _u32s(buf, 0, end, 1, "the magic")
    kind = MAGICS.get(code)
    if kind is None:
        raise ParseError(f"magic {code:#010x} is not ggml, ggmf or ggjt", offset=0)
    version = None
    if kind != "ggml":
        (version,), pos = _u32s(buf, pos, end, 1, "the version")
        if version not in VERSIONS[kind]:
            raise ParseError(f"{kind} version {version}; known: {', '.join(map(str, VERSIONS[kind]))}", offset=4)
    values, pos = _u32s(buf, pos, end, len(HPARAMS), "the hyperparameters")
    hparams = dict(zip(HPARAMS, values, strict=True))
    if not 0 < hparams["n_vocab"] <= MAX_VOCAB:
        raise ParseError(f"n_vocab {hparams['n_vocab']} is not a vocabulary size", offset=pos - 28)
    scored = kind != "ggml"
    tokens, scores = [], []
    for _ in range(hparams["n_vocab"]):
        (length,), pos = _u32s(buf, pos, end, 1, "a token's length")
        if length > MAX_TOKEN_BYTES or length + (4 if scored else 0) > end - pos:
            raise ParseError(f"a token of {length} bytes does not fit (at most {MAX_TOKEN_BYTES}, in the file)",
                             offset=pos)
        tokens.append(bytes(buf[pos:pos + length]))
        pos += length
        if scored:
            scores.append(struct.unpack_from("<f", buf, pos)[0])
            pos += 4
        else:
            scores.append(0.0)
    types = TYPES_V3 if kind == "ggjt" and version == 3 else TYPES_OLD
    tensors: list[Tensor] = []
    seen: set[str] = set()
    while pos < end:
        if len(tensors) >= MAX_TENSORS:
            raise ParseError(f"more than {MAX_TENSORS} tensors", offset=pos)
        (n_dims, name_len, type_code), pos = _u32s(buf, pos, end, 3, "a tensor header")
        if not 1 <= n_dims <= MAX_DIMS or name_len > MAX_NAME_BYTES:
            raise ParseError(f"a tensor with {n_dims} dimensions and a {name_len}-byte name", offset=pos - 12)
        if type_code not in types:
            raise ParseError(f"ggml type {type_code} is not one a {kind} file of this version holds", offset=pos - 4)
        ne, pos = _u32s(buf, pos, end, n_dims, "a tensor's dimensions")
        if name_len > end - pos:
            raise ParseError("a tensor name runs past the end of the file", offset=pos)
        try:
            name = bytes(buf[pos:pos + name_len]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ParseError("a tensor name is not UTF-8", offset=pos) from e
        pos += name_len
        if kind == "ggjt":
            pos += -pos % ALIGNMENT
        type_name, block, size = types[type_code]
        count = 1
        for d in ne:
            count *= d
        if count == 0 or ne[0] % block:
            raise ParseError(f"tensor {name!r}: {list(ne)} is empty or its rows do not split into {type_name} blocks "
                             f"of {block}", offset=pos)
        nbytes = count // block * size
        if pos > end or nbytes > end - pos:
            raise ParseError(f"tensor {name!r} needs {nbytes} bytes at {pos}; the file has {end}", offset=pos)
        if name in seen:
            raise ParseError(f"tensor {name!r} appears twice", offset=pos)
        seen.add(name)
        tensors.append(Tensor(name, type_code, type_name, tuple(ne), pos, nbytes))
        pos += nbytes
    return GgmlFile(kind, version, hparams, tokens, scores, tensors)
