"""Open model files: as a lazy Checkpoint, or rebuilt into a runnable module (float or quantized).

Every reader is reached through the format table; pickle-bearing formats pass the scanner gate
inside their converter before anything is read.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelkit.checkpoint import ArchSpec, Checkpoint, instantiate
from modelkit.formats import (
    FORMATS,
    ReadOptions,
    WriteOptions,
    check_readable,
    detect_format,
    format_for_output,
    load_format,
)
from modelkit.pipeline.verify import reference_module
from modelkit.pipeline.write import write_checkpoint

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torch import nn

PathLike = str | os.PathLike[str]


def resolve_input(path: PathLike, format: str | None) -> tuple[Path, str]:
    path = Path(path)
    check_readable(path)
    if format is not None:
        load_format(format)  # unknown names raise with "did you mean"
        return path, format
    return path, detect_format(path)


def load(path: PathLike, *, format: str | None = None, trust: bool = False, key: str | None = None,
         dequantize: bool = False) -> Checkpoint:
    """Open a model file as a lazy Checkpoint; no tensor data is read until asked for.

    Args:
        path: The file (or sharded folder) to read.
        format: Force a format instead of detecting it from the content.
        trust: Allow content that runs code when loaded (whole-module pickles, TorchScript).
        key: For nested checkpoints, the entry holding the state_dict ("model", "state_dict").
        dequantize: Return quantized tensors (GGUF block types) as float tensors.

    Example:
        >>> ckpt = modelkit.load("runs/cnn/model.safetensors")       # doctest: +SKIP
        >>> ckpt.arch.name, ckpt.num_parameters                       # doctest: +SKIP
        ('cnn', 38538)
    """
    path, fmt = resolve_input(path, format)
    return load_format(fmt).read(path, ReadOptions(trust=trust, key=key, dequantize=dequantize))


def save(ckpt: Checkpoint, path: PathLike, *, format: str | None = None, force: bool = False,
         verify: bool = True) -> Path:
    """Write `ckpt` to `path` through the one write path: a temporary file, fsynced, verified
    (every tensor read back bit for bit; graph formats also run against the rebuilt model),
    renamed into place. Returns the path.

    Args:
        ckpt: What to write.
        path: The output; its format comes from `format` or the suffix.
        format: Output format name.
        force: Overwrite an existing file.
        verify: Check the written file (on by default); a failure raises VerificationError and
            leaves no output.
    """
    path = Path(path)
    fmt = format_for_output(path, format)
    module = reference_module(ckpt, target=fmt) if verify and FORMATS[fmt].has_graph else None
    write_checkpoint(ckpt, path, fmt, WriteOptions(module=module, final_path=path), force=force, verify=verify,
                     module=module)
    return path


def load_module(path: PathLike, *, format: str | None = None, arch: ArchSpec | str | None = None,
                trust: bool = False, key: str | None = None) -> nn.Module:
    """Rebuild a runnable model from a file: its ArchSpec (or `arch`) plus its weights.

    Args:
        path: Any readable model file.
        format: Force a format instead of detecting it.
        arch: A registered model name, an ArchSpec, or a factory "pkg.module:function", for
            files that name no architecture (or to override it).
        trust: Allow content that runs code when loaded (see `load`).
        key: For nested checkpoints, the entry holding the state_dict (see `load`).

    Raises:
        UnsupportedConversionError: the file names no architecture and none was given.

    Example:
        >>> model = modelkit.load_module("runs/cnn/model.safetensors")   # doctest: +SKIP
    """
    ckpt = load(path, format=format, trust=trust, key=key)
    return instantiate(ckpt, arch=arch, source=str(path))     # quantized tensors become quantized layers


@dataclass
class LanguageModel:
    """A runnable model with what running it as a language model needs: its tokenizer (transformers', for a
    Hugging Face family's model that carries tokenizer files; None for the zoo) and its files (`assets`:
    generation_config.json, chat template)."""

    model: nn.Module
    tokenizer: Any
    assets: Mapping[str, bytes]
    weights_dtype: str | None = None       # the float type the file stores most matrix bytes in ("bfloat16")


def load_language_model(path: PathLike, *, format: str | None = None, arch: ArchSpec | str | None = None,
                        trust: bool = False, key: str | None = None, dequantize: bool = False) -> LanguageModel:
    """`load_module`, with the tokenizer a Hugging Face family's model carries (a folder's tokenizer.json and
    friends, or those a GGUF's tokenizer keys rebuild). `dequantize` builds the float model from a file
    holding quantized tensors (instantiate's), instead of quantized layers."""
    from modelkit.models import _hf, hf_config_of

    ckpt = load(path, format=format, trust=trust, key=key)
    model = instantiate(ckpt, arch=arch, source=str(path), dequantize=dequantize)
    has_tokenizer = "tokenizer.json" in ckpt.assets or "tokenizer.model" in ckpt.assets
    tokenizer = _hf.tokenizer(ckpt.assets, source=str(path)) if has_tokenizer and hf_config_of(model) is not None else None
    return LanguageModel(model, tokenizer, ckpt.assets, _weights_dtype(ckpt))


def _weights_dtype(ckpt: Checkpoint) -> str | None:
    """The floating type holding most of the file's 2-D float weights (None when it stores none)."""
    from collections import Counter

    from modelkit.storage.dtypes import dtype_name

    counts: Counter[str] = Counter()
    for t in ckpt.tensors.values():
        if len(t.shape) == 2 and getattr(t.dtype, "is_floating_point", False):
            counts[dtype_name(t.dtype)] += t.nbytes
    return counts.most_common(1)[0][0] if counts else None
