"""A TensorFlow tensor bundle (a checkpoint PREFIX, or a SavedModel's variables/variables) as named lazy tensors.

The index is parsed by modelkit.parse.tf_bundle; here each numeric entry becomes a LazyTensor that reads
its bytes from its shard and checks them against the entry's crc32c (modelkit.storage.checksums) when
loaded, and the checkpoint keys get readable names:

- TensorFlow 2 keys are object-graph paths (`layer_with_weights-0/kernel/.ATTRIBUTES/VARIABLE_VALUE`,
  `variables/0/.ATTRIBUTES/VARIABLE_VALUE` in a Keras export). The object graph stored in the bundle
  gives each variable's own name (`full_name`: `sequential/dense/kernel`, what Keras and tf.Variable
  call it). When those names tell the variables apart, they are the tensor names; a variable saved under
  several keys (a Keras export saves each under `variables/N` and `_all_variables/M`: same dtype, shape
  and crc32c) is kept once. Otherwise the object path without `/.ATTRIBUTES/VARIABLE_VALUE` is the name.
- TensorFlow 1 keys (no object graph) are the variables' names already and are kept.

Every tensor's original key (and the keys it also had) is in the metadata key `modelkit.tensorflow.keys`.
Strings, resources and partitioned variables are not tensors modelkit holds; they are listed there as skipped.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from modelkit.errors import FormatError, ParseError
from modelkit.metadata import TF_KEYS_KEY
from modelkit.parse import tf_bundle
from modelkit.parse.paths import read_capped
from modelkit.storage.checksums import crc32c
from modelkit.storage.tensors import LazyTensor

VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
MAX_OBJECT_GRAPH_BYTES = 256 << 20


def _read_exact(path: str, offset: int, size: int) -> bytearray:
    """The bytes, in a buffer of their own (writable: arrays made from it are, as torch wants)."""
    data = bytearray(size)
    with open(path, "rb") as f:
        f.seek(offset)
        got = f.readinto(data)
    if got != size:
        raise FormatError(path, f"ends before byte {offset + size}: the shard is cut short")
    return data


def _lazy(path: str, entry: tf_bundle.Entry, index: Path) -> LazyTensor:
    from modelkit.storage.dtypes import DTYPES

    dtype = DTYPES[entry.dtype]

    def read() -> np.ndarray:
        data = _read_exact(path, entry.offset, entry.size)
        if entry.crc32c is not None and crc32c(data) != entry.crc32c:
            raise FormatError(path, f"tensor {entry.key!r}: its bytes do not match the crc32c in {index.name} "
                                    "(a damaged or altered checkpoint)")
        return np.frombuffer(data, dtype=dtype.numpy).reshape(entry.shape)

    return LazyTensor(dtype, entry.shape, read, f"{path}:{entry.key}")


def _names(entries: list[tf_bundle.Entry], variables: list[tf_bundle.Variable]) -> dict[str, list[str]]:
    """Readable name -> the keys holding it (the first is the tensor's; the others are copies of it)."""
    by_key = {v.checkpoint_key: v for v in variables}

    def path_name(key: str) -> str:
        variable = by_key.get(key)
        name = variable.path if variable is not None and variable.path else key
        return name.removesuffix(VALUE_SUFFIX)

    full: dict[str, list[tf_bundle.Entry]] = {}
    for entry in entries:
        variable = by_key.get(entry.key)
        if variable is None or not variable.full_name:
            full = {}
            break
        full.setdefault(variable.full_name, []).append(entry)
    same = all(len({(e.dtype_code, e.shape, e.crc32c) for e in group}) == 1 and group[0].crc32c is not None
               for group in full.values())
    if full and same:
        return {name: [e.key for e in group] for name, group in full.items()}
    names: dict[str, list[str]] = {}
    for entry in entries:
        names.setdefault(path_name(entry.key), []).append(entry.key)
    return {name if len(keys) == 1 else key: [key] for name, keys in names.items() for key in keys}


def read_bundle(prefix: Path) -> tuple[dict[str, LazyTensor], dict[str, str]]:
    """The numeric tensors of the bundle at `prefix` (PREFIX.index beside PREFIX.data-*), and the metadata
    recording their checkpoint keys.

    Raises:
        FormatError: the index or a shard is missing, malformed or shorter than its entries need.
    """
    index = Path(f"{prefix}.index")
    try:
        bundle = tf_bundle.read_index(read_capped(index, tf_bundle.MAX_INDEX_BYTES, "a checkpoint index"))
    except OSError as e:
        raise FormatError(index, f"cannot read the checkpoint index ({e.strerror})") from e
    except ParseError as e:
        raise FormatError(index, str(e)) from e
    shards: dict[int, tuple[str, int]] = {}
    for shard in sorted({e.shard for e in bundle.entries.values()}):
        name = tf_bundle.shard_name(str(prefix), shard, bundle.num_shards)
        try:
            shards[shard] = (name, os.stat(name).st_size)
        except OSError as e:
            raise FormatError(name, f"the checkpoint's data shard {shard} cannot be read ({e.strerror}); "
                                    f"{index.name} needs it") from e
    for entry in bundle.entries.values():
        name, size = shards[entry.shard]
        if entry.offset + entry.size > size:
            raise FormatError(name, f"tensor {entry.key!r} needs bytes {entry.offset}..{entry.offset + entry.size}, "
                                    f"the shard has {size}")
    variables: list[tf_bundle.Variable] = []
    graph = bundle.entries.get(tf_bundle.OBJECT_GRAPH_KEY)
    if graph is not None and graph.dtype == "string" and graph.size <= MAX_OBJECT_GRAPH_BYTES:
        try:
            blob = tf_bundle.strings(_read_exact(shards[graph.shard][0], graph.offset, graph.size), 1)[0]
            variables = tf_bundle.object_graph(blob)
        except ParseError as e:
            raise FormatError(index, f"the checkpoint's object graph cannot be read: {e}") from e
    order = {v.checkpoint_key: i for i, v in reversed(list(enumerate(variables)))}
    kept = sorted((e for e in bundle.entries.values()           # the object graph's order (layer by layer), then keys
                   if e.dtype in tf_bundle.ITEMSIZE and not e.sliced and e.key != tf_bundle.OBJECT_GRAPH_KEY),
                  key=lambda e: (order.get(e.key, len(order)), e.key))
    skipped = sorted(f"{e.key} ({'partitioned' if e.sliced else e.dtype_name})" for e in bundle.entries.values()
                     if e not in kept and e.key != tf_bundle.OBJECT_GRAPH_KEY)
    by_key = {e.key: e for e in kept}
    full_names = {v.checkpoint_key: v.full_name for v in variables}
    tensors: dict[str, LazyTensor] = {}
    record: dict[str, dict[str, object]] = {}
    for name, keys in _names(kept, variables).items():
        entry = by_key[keys[0]]
        tensors[name] = _lazy(shards[entry.shard][0], entry, index)
        record[name] = {"key": keys[0], **({"full_name": full_names[keys[0]]} if full_names.get(keys[0]) else {}),
                        **({"also": keys[1:]} if len(keys) > 1 else {})}
    metadata = {TF_KEYS_KEY: json.dumps({"tensors": record, **({"skipped": skipped} if skipped else {})},
                                        sort_keys=True)}
    return tensors, metadata
