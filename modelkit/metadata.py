"""JSON entries in a file's string metadata (safetensors __metadata__, ONNX metadata_props, GGUF
keys, the pt state_dict's _metadata): parsed with one checked path, so every reader gives the same
one-line FormatError for a broken or oversized entry."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from modelkit.errors import FormatError

# Metadata keys modelkit writes into files (safetensors __metadata__, GGUF keys, ONNX metadata_props,
# the pt state_dict's _metadata). Every value is a JSON string unless said otherwise.
ARCH_KEY = "modelkit.arch"          # the ArchSpec: {"name": registered model, "config": {...}}
METRICS_KEY = "modelkit.metrics"    # evaluation figures by split
ALIASES_KEY = "modelkit.aliases"    # tied names -> the name whose tensor they share


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
    except (json.JSONDecodeError, TypeError) as e:
        raise FormatError(path, f"the {key} entry is not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise FormatError(path, f"the {key} entry must {what}")
    return value
