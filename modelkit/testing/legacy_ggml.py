"""A writer of legacy llama.cpp files ('ggml', 'ggmf', 'ggjt' v1-v3) and a tiny llama in them, for tests and
fixtures/ggml/make_judge.py.

Written from the format's definition (modelkit.parse.ggml's docstring): the 7 llama hyperparameters, the
vocabulary (with scores after 'ggml'), then tensor records, aligned to 32 bytes in 'ggjt'. The tensors are
named as Meta's llama checkpoints and llama.cpp's old files named them (tok_embeddings, layers.N.attention.wq,
...), with Q/K rows in llama.cpp's RoPE order, as those files held them. Blocks are quantized by gguf-py's
reference quantizer, whose Q4_0/Q4_1/Q8_0 blocks are ggjt v3's (f16 scales). For versions before ggjt v3,
only F32/F16 carry real values; their quantized blocks (f32 scales) are zero-filled stand-ins of the right
size, for the tests that such files are refused.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from modelkit.parse.ggml import HPARAMS, MAGICS, TYPES_OLD, TYPES_V3

_CODES = {name: code for code, name in MAGICS.items()}
_TYPE_CODES = {name: code for code, (name, _, _) in TYPES_V3.items()}
# ftype llama.cpp wrote for a file mostly of one type (LLAMA_FTYPE_*)
FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}
# A SentencePiece-style BPE vocabulary after the 256 byte tokens: single characters (lowest scores), then each
# word's prefixes in merge order (every piece the concatenation of two earlier ones, as BPE vocabularies are),
# spaces as ' ' as the legacy files stored them.
WORDS = [" the", " return", "def", " self", "self", " f", "in", "er", "he", " and", " in", " to", " of", " is", "ing",
         "on", "at", "en", " x", " if", " for", "or"]
CHARS = "".join(sorted(set("".join(WORDS)) | set("():.=+,")))


def pieces() -> list[str]:
    """The merged pieces in rank order (first = most frequent merge)."""
    out: list[str] = []
    for word in WORDS:
        for end in range(2, len(word) + 1):
            if word[:end] not in out:
                out.append(word[:end])
    return out


def vocabulary() -> tuple[list[bytes], list[float]]:
    """<unk>, <s>, </s>, the 256 bytes (one byte each, ids 3..258), the characters, then the merged pieces:
    a merged piece scores minus its rank, a character below every merge (SentencePiece's BPE scores)."""
    merged = pieces()
    tokens = [" \u2047 ".encode(), b"", b"", *(bytes([b]) for b in range(256)), *(c.encode() for c in CHARS),
              *(p.encode() for p in merged)]
    scores = [0.0] * 259 + [-float(len(merged) + i) for i in range(len(CHARS))] + [-float(i) for i in range(len(merged))]
    return tokens, scores


def encode(*, kind: str, version: int | None, hparams: dict[str, int], tokens: list[bytes], scores: list[float],
           tensors: list[tuple[str, str, tuple[int, ...], bytes]]) -> bytes:
    """A legacy file's bytes; tensors are (name, type name, ne (fastest first), data bytes)."""
    out = bytearray(struct.pack("<I", _CODES[kind]))
    if kind != "ggml":
        out += struct.pack("<I", version)
    out += struct.pack("<7I", *(hparams[k] for k in HPARAMS))
    for token, score in zip(tokens, scores, strict=True):
        out += struct.pack("<I", len(token)) + token
        if kind != "ggml":
            out += struct.pack("<f", score)
    for name, type_name, ne, data in tensors:
        raw = name.encode()
        out += struct.pack("<3I", len(ne), len(raw), _TYPE_CODES[type_name]) + struct.pack(f"<{len(ne)}I", *ne) + raw
        if kind == "ggjt":
            out += bytes(-len(out) % 32)
        out += data
    return bytes(out)


def tiny_llama(path: Path, type_name: str = "F32", **options) -> Path:
    """Write tiny_llama_bytes(type_name, **options) to `path`."""
    path.write_bytes(tiny_llama_bytes(type_name, **options))
    return path


def tiny_llama_bytes(type_name: str = "F32", *, kind: str = "ggjt", version: int | None = 3, seed: int = 0,
                     n_embd: int = 32, n_head: int = 4, n_kv_head: int | None = None, n_layer: int = 2,
                     n_ff: int = 64) -> bytes:
    """A seeded random llama in a legacy file: 2-D weights in `type_name`, norms in F32 (as llama.cpp did)."""
    import gguf
    from gguf import quants

    rng = np.random.default_rng(seed)
    tokens, scores = vocabulary()
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    n_kv = n_kv_head or n_head
    shapes = {"tok_embeddings.weight": (n_vocab, n_embd), "norm.weight": (n_embd,), "output.weight": (n_vocab, n_embd)}
    for i in range(n_layer):
        shapes |= {f"layers.{i}.attention.wq.weight": (n_embd, n_embd),
                   f"layers.{i}.attention.wk.weight": (n_kv * head_dim, n_embd),
                   f"layers.{i}.attention.wv.weight": (n_kv * head_dim, n_embd),
                   f"layers.{i}.attention.wo.weight": (n_embd, n_embd),
                   f"layers.{i}.feed_forward.w1.weight": (n_ff, n_embd),
                   f"layers.{i}.feed_forward.w2.weight": (n_embd, n_ff),
                   f"layers.{i}.feed_forward.w3.weight": (n_ff, n_embd),
                   f"layers.{i}.attention_norm.weight": (n_embd,), f"layers.{i}.ffn_norm.weight": (n_embd,)}
    tensors = []
    old = not (kind == "ggjt" and version == 3)
    for name, shape in shapes.items():
        if len(shape) == 1:
            values = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            tensors.append((name, "F32", shape[::-1], values.tobytes()))
            continue
        values = (0.08 * rng.standard_normal(shape)).astype(np.float32)
        if type_name == "F32":
            data = values.tobytes()
        elif type_name == "F16":
            data = values.astype(np.float16).tobytes()
        elif old:
            _, block, size = TYPES_OLD[_TYPE_CODES[type_name]]
            data = bytes(values.size // block * size)
        else:
            data = quants.quantize(values, gguf.GGMLQuantizationType[type_name]).tobytes()
        tensors.append((name, type_name, shape[::-1], data))
    hparams = {"n_vocab": n_vocab, "n_embd": n_embd, "n_mult": 32, "n_head": n_head, "n_layer": n_layer,
               "n_rot": head_dim, "ftype": FTYPES[type_name]}
    return encode(kind=kind, version=version, hparams=hparams, tokens=tokens, scores=scores, tensors=tensors)
