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
from modelkit.parse.paths import read_capped

CONFIG_NAME = "config.json"
MAX_JSON = 50_000_000          # the largest config or tokenizer file modelkit reads (real tokenizer.json: ~10 MB)
# Files that travel with the weights (Checkpoint.assets), by name.
ASSETS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
          "tokenizer.model", "chat_template.jinja")


def read_bytes(path: Path) -> bytes:
    """A folder file's bytes, refusing one larger than MAX_JSON."""
    return read_capped(path, MAX_JSON, "a model folder's JSON file")


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


def tokenizer_summary(assets: dict[str, bytes]) -> dict[str, Any] | None:
    """What a folder's tokenizer files say: the model kind (BPE, Unigram, WordPiece, WordLevel), its
    style (byte-level, sentencepiece-style: Metaspace or byte fallback), vocabulary size and whether a chat
    template is present; None when the folder has no tokenizer."""
    template = "chat_template.jinja" in assets
    if "tokenizer_config.json" in assets:
        try:
            config = json.loads(assets["tokenizer_config.json"])
            template = template or bool(isinstance(config, dict) and config.get("chat_template"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            pass
    if "tokenizer.json" not in assets:
        if "tokenizer.model" in assets:
            return {"kind": "SentencePiece model", "style": "sentencepiece", "vocab_size": None, "chat_template": template}
        return None
    try:
        doc = json.loads(assets["tokenizer.json"])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return {"kind": "unreadable tokenizer.json", "style": None, "vocab_size": None, "chat_template": template}
    model = doc.get("model") if isinstance(doc, dict) else None
    model = model if isinstance(model, dict) else {}
    text = json.dumps([doc.get("pre_tokenizer"), doc.get("decoder"), doc.get("normalizer")])
    if '"ByteLevel"' in text:
        style = "byte-level"
    elif '"Metaspace"' in text or model.get("byte_fallback") or model.get("type") == "Unigram":
        style = "sentencepiece"
    else:
        style = "other"
    vocab = model.get("vocab")
    size = len(vocab) if isinstance(vocab, (dict, list)) else 0
    added = doc.get("added_tokens") if isinstance(doc.get("added_tokens"), list) else []
    ids = {t.get("id") for t in added if isinstance(t, dict)}
    known = set(vocab.values()) if isinstance(vocab, dict) else set(range(size))
    return {"kind": model.get("type", "unknown"), "style": style, "vocab_size": size + len(ids - known),
            "chat_template": template}
