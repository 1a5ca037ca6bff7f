"""savedmodel: a TensorFlow SavedModel folder (`saved_model.pb`, `variables/`, `assets/`), its variables read
without TensorFlow.

Spec: tensorflow/core/protobuf/saved_model.proto and friends (modelkit.parse.savedmodel); the variables are
a tensor bundle, `variables/variables.index` + `.data-*` (converters/tfcheckpoint.py's format, read by
modelkit.storage.tf_bundle: shard bounds, crc32c, readable names from the object graph).

The graph is never run. The scanner judges it first (the gate): ops that read, list or write files, run the
host's Python or talk to the network, in the top-level graph or any library function, refuse the load
(modelkit.scan.tensorflow). The metadata records the meta graph's tags, signatures and TensorFlow version
(`modelkit.tensorflow.source`) and each tensor's checkpoint key (`modelkit.tensorflow.keys`).

Read-only: modelkit converts a SavedModel's variables to its weight formats and never writes SavedModels.
"""
from __future__ import annotations

import json
from pathlib import Path

from modelkit.checkpoint import Checkpoint
from modelkit.errors import FormatError, UnsupportedConversionError, reading
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.metadata import TF_SOURCE_KEY
from modelkit.parse import savedmodel as saved
from modelkit.parse.detect import savedmodel as detect  # noqa: F401  (the converter's detect)
from modelkit.parse.paths import read_capped
from modelkit.storage.tf_bundle import read_bundle

MAX_PB_BYTES = 2 << 30          # protobuf's own limit on one message


def _folder(path: Path) -> Path:
    return path if path.is_dir() else path.parent


def read(path: Path, options: ReadOptions = ReadOptions()) -> Checkpoint:
    """The SavedModel's variables as lazy tensors, after the scanner has judged its graph."""
    from modelkit.scan import gate

    folder = _folder(path)
    pb = folder / saved.SAVED_MODEL_FILE
    if not pb.is_file():
        where = "in it" if path.is_dir() else "beside it"
        raise FormatError(path, f"is not a TensorFlow SavedModel: no {saved.SAVED_MODEL_FILE} {where}; name the "
                                "SavedModel's folder (or leave out --format to detect the format)")
    gate(pb, trust=options.trust)
    with reading(pb):
        model = saved.read(read_capped(pb, MAX_PB_BYTES, "a protobuf"))
    prefix = folder / saved.VARIABLES_PREFIX
    if not Path(f"{prefix}.index").is_file():
        if any(n.op in saved.VARIABLE_OPS for m in model.meta_graphs for n in m.nodes):
            raise FormatError(Path(f"{prefix}.index"), f"missing, but the graph in {pb.name} declares variables, "
                              "whose values live there; copy the SavedModel's whole folder, variables/ included")
        tensors, metadata = {}, {}          # a SavedModel with no variables (constants only)
    else:
        tensors, metadata = read_bundle(prefix)
    metadata[TF_SOURCE_KEY] = json.dumps([{"tags": m.tags, "tensorflow_version": m.tensorflow_version,
                                           "signatures": sorted(s for s in m.signatures if not s.startswith("__"))}
                                          for m in model.meta_graphs], sort_keys=True)
    return Checkpoint(tensors, metadata)


def write(ckpt: Checkpoint, path: Path, options: WriteOptions = WriteOptions()) -> None:
    raise UnsupportedConversionError("checkpoint", "savedmodel", "modelkit reads SavedModels' variables but does not "
                                     "write SavedModels; write safetensors, GGUF, HDF5 (Keras), tfjs or ONNX instead")
