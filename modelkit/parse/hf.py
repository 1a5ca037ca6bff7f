"""A Hugging Face model folder's JSON files (config.json, tokenizer_config.json, ...): read with a size
cap, parsed as one JSON object. Detection and the hf converter read them here. Standard library only.

A save_pretrained folder: config.json (`model_type`, hyperparameters), model.safetensors or
model-0000N-of-0000M.safetensors + model.safetensors.index.json, and the tokenizer's files
(ASSETS), each optional.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from modelkit.errors import ParseError

CONFIG_NAME = "config.json"
MAX_JSON = 50_000_000          # the largest config or tokenizer file modelkit reads (real tokenizer.json: ~10 MB)
# Files that travel with the weights (Checkpoint.assets), by name.
ASSETS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
          "tokenizer.model")


def read_bytes(path: Path) -> bytes:
    """A folder file's bytes, refusing one larger than MAX_JSON."""
    size = path.stat().st_size
    if size > MAX_JSON:
        raise ParseError(f"{path.name} is {size} bytes; refusing anything over {MAX_JSON}", source=str(path))
    return path.read_bytes()


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a folder file."""
    try:
        value = json.loads(read_bytes(path))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ParseError(f"not valid JSON ({e})", source=str(path)) from e
    if not isinstance(value, dict):
        raise ParseError("must hold a JSON object", source=str(path))
    return value


def read_config(folder: Path) -> dict[str, Any]:
    """config.json of a model folder; its `model_type` must be a string."""
    config = read_json(folder / CONFIG_NAME)
    if not isinstance(config.get("model_type"), str):
        raise ParseError("names no model_type (a Hugging Face config.json has one)", source=str(folder / CONFIG_NAME))
    return config


def is_model_folder(folder: Path) -> bool:
    """A folder with a config.json naming a `model_type` (read only if it is small) and safetensors weights."""
    config = folder / CONFIG_NAME
    try:
        if not folder.is_dir() or not config.is_file() or config.stat().st_size > 1_000_000:
            return False
        if not ((folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()):
            return False
        read_config(folder)
    except (OSError, ParseError):
        return False
    return True
