"""Every metadata key modelkit writes into files, in one place, and the JSON entries under them
(safetensors __metadata__, ONNX metadata_props, GGUF keys, the pt state_dict's _metadata) parsed
with one checked path, so every reader gives the same one-line FormatError for a broken or
oversized entry. The key values are on disk in files already written: never change one."""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from modelkit.errors import FormatError

# Metadata keys modelkit writes into files (safetensors __metadata__, GGUF keys, ONNX metadata_props,
# the pt state_dict's _metadata). Every value is a JSON string unless said otherwise.
ARCH_KEY = "modelkit.arch"          # the ArchSpec: {"name": registered model, "config": {...}}
METRICS_KEY = "modelkit.metrics"    # evaluation figures by split
ALIASES_KEY = "modelkit.aliases"    # tied names -> the name whose tensor they share
QUANTIZED_KEY = "modelkit.quantized"    # N -> {scheme, layout, shape, dtype, params, format?, parts: {part: stored}}
QUANT_KEY = "modelkit.quantization"     # the scheme's config (config_to_dict) that quantized the file
FILE_TYPE_KEY = "modelkit.file_type"    # llama.cpp's LLAMA_FTYPE of a recipe (a decimal string): the GGUF writer
                                        # stores it as general.file_type instead of a guess (not as metadata)
PRUNE_KEY = "modelkit.prune"        # the PruneConfig and fine-tuning epochs that pruned the file
DISTILL_KEY = "modelkit.distill"    # the distillation recipe (teacher, temperature, alpha, ...)
TRAIN_KEY = "modelkit.train"        # the training recipe
# Format-specific entries (the values are on disk: never change them)
NAMES_KEY = "modelkit.names"        # ONNX: state_dict name -> {"initializer": name, "transpose": perm}
                                    # tfjs: state_dict name -> {"weight": "dense/kernel", "transform", "flatten"?}
VERSION_KEY = "modelkit.version"    # ONNX: the modelkit version that wrote the file (a plain string)
TENSORS_KEY = "modelkit.tensors"    # GGUF: stored name -> {"name", "dtype", "shape"} where they differ
META_PREFIX = "modelkit.meta."      # GGUF: + each Checkpoint metadata key; the value verbatim
KERAS_LAYOUT_ATTR = "modelkit.keras_layout"   # HDF5 root attribute: "keras" | "none" (a plain string)
KERAS_NOTE_ATTR = "modelkit.keras_note"       # HDF5 root attribute: the Keras model it fits, or why none
KERAS_JSON_ATTR = "modelkit.keras_json"       # HDF5 root attribute: that model as Keras's to_json() writes it
TORCHSCRIPT_EXTRA = "modelkit.json"           # TorchScript: the extra file holding metadata and ArchSpec
PT2_EXTRA = "modelkit.json"                   # PT2: the extra file (extra/modelkit.json) holding metadata and ArchSpec
TORCHSCRIPT_EXPORT_KEY = "modelkit.torchscript.export"   # TorchScript, on reading: "script" or "trace"
PTH_SOURCE_KEY = "modelkit.pth.source"        # pt/pth, on reading: which entry or object the state_dict came from
PTH_METADATA_ENTRY = "__modelkit__"           # pt/pth: the state_dict._metadata entry holding our metadata
PTH_LAYOUT = "modelkit.pth/1"                 # pt/pth: that entry's layout version
NPZ_MEMBER = "modelkit.json"                  # npz: the member holding metadata, ArchSpec and true dtypes
NPZ_LAYOUT = "modelkit.npz/1"                 # npz: that member's layout version
TF_KEYS_KEY = "modelkit.tensorflow.keys"      # SavedModel / TF checkpoint, on reading: tensor name -> {"key": the
                                              # checkpoint key, "full_name": TF's variable name, "also": other keys}
TF_SOURCE_KEY = "modelkit.tensorflow.source"  # SavedModel, on reading: its tags and TensorFlow version (JSON)
GGML_SOURCE_KEY = "modelkit.ggml.source"     # legacy ggml, on reading: the file's kind, version and ftype


def json_object(path: Path | str, key: str, raw: str, *, what: str, limit: int | None = None) -> dict[str, Any]:
    """Metadata entry `key` as a JSON object; FormatError naming the file and the entry otherwise.

    Args:
        what: What the object must map, for the message: "map names to names".
        limit: Refuse entries longer than this many characters before parsing them.
    """
    if limit is not None and len(raw) > limit:
        raise FormatError(path, f"the {key} entry is {len(raw)} bytes; refusing anything over {limit}")
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, TypeError, RecursionError) as e:     # RecursionError: nested too deep
        raise FormatError(path, f"the {key} entry is not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise FormatError(path, f"the {key} entry must {what}")
    return value


def tied_names(path: Path | str, metadata: dict[str, str], names: Iterable[str]) -> dict[str, str]:
    """The tied tensors a file records under ALIASES_KEY (alias -> stored name); FormatError naming the
    file when the entry is not such a map or names a tensor the file does not store."""
    raw = metadata.get(ALIASES_KEY)
    if raw is None:
        return {}
    aliases = json_object(path, ALIASES_KEY, raw, what="map names to names")
    stored = set(names)
    for alias, target in aliases.items():
        if not isinstance(target, str) or target not in stored:
            raise FormatError(path, f"tied tensor {alias!r} points to {target!r}, which is not in the file")
    return aliases
