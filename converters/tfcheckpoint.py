"""tfcheckpoint: a TensorFlow checkpoint, `PREFIX.index` + `PREFIX.data-NNNNN-of-MMMMM` (tf.train.Checkpoint,
tf.compat.v1.train.Saver, Keras's TensorFlow checkpoints), read without TensorFlow.

Spec: tensorflow/core/util/tensor_bundle (the index is a sorted string table of BundleEntryProto; the data
shards hold raw little-endian tensor bytes), read by modelkit.parse.tf_bundle and modelkit.storage.tf_bundle:
every entry's offset and size checked against its shard before anything is read, every tensor's bytes
checked against the entry's crc32c when loaded, readable names from the checkpoint's object graph (the
original keys in the metadata key `modelkit.tensorflow.keys`). docs/formats/tensorflow.md has the details.

The input is PREFIX.index, or a folder holding one checkpoint. Read-only: modelkit converts checkpoints to
its weight formats (safetensors, GGUF, ...) and never writes TensorFlow checkpoints.
"""
from __future__ import annotations

from pathlib import Path

from modelkit.checkpoint import Checkpoint
from modelkit.errors import FormatError, UnsupportedConversionError
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.parse.detect import tf_index
from modelkit.parse.detect import tfcheckpoint as detect  # noqa: F401  (the converter's detect)
from modelkit.storage.tf_bundle import read_bundle


def read(path: Path, options: ReadOptions = ReadOptions()) -> Checkpoint:
    """The checkpoint's numeric variables as lazy tensors."""
    from modelkit.scan import gate

    index = tf_index(path)
    if index is None:
        raise FormatError(path, "is not a TensorFlow checkpoint: name its PREFIX.index file, or a folder holding one")
    gate(index, trust=options.trust)
    tensors, metadata = read_bundle(index.with_suffix(""))
    return Checkpoint(tensors, metadata)


def write(ckpt: Checkpoint, path: Path, options: WriteOptions = WriteOptions()) -> None:
    raise UnsupportedConversionError("checkpoint", "tfcheckpoint", "modelkit reads TensorFlow checkpoints but does "
                                     "not write them; write safetensors, GGUF, HDF5 (Keras) or ONNX instead")
