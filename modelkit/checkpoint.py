"""Checkpoint: the one object every reader returns and every writer takes.

Tensors are lazy: a reader fills in dtype and shape from the file's header and a function that
reads the bytes when asked, so opening a large file reads no tensor data, and a converter holds
one tensor at a time. The tensor types live in modelkit.storage.tensors and the ArchSpec in
modelkit.models; both are re-exported here, where users look for them. Nothing here imports torch
until a caller hands in or asks for torch objects (from_module, materialize, instantiate).
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelkit import models
from modelkit.errors import ConfigError, UnsupportedConversionError
from modelkit.metadata import ALIASES_KEY, ARCH_KEY, METRICS_KEY
from modelkit.models import ArchSpec
from modelkit.storage.tensors import (
    DEQUANTIZERS,
    LAYOUT_MODULES,
    LazyTensor,
    QuantizedTensor,
    TensorEntry,
    dequantizer,
)

if TYPE_CHECKING:        # torch is imported by the functions that take or make torch objects, not here
    import torch
    from torch import nn

__all__ = ["ALIASES_KEY", "ARCH_KEY", "DEQUANTIZERS", "LAYOUT_MODULES", "METRICS_KEY", "ArchSpec", "Checkpoint",
           "LazyTensor", "QuantizedTensor", "TensorEntry", "dequantizer", "instantiate"]


def _tied_names(state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Names whose tensor is a view of the same memory as an earlier name (tied weights)."""
    seen: dict[tuple, str] = {}
    aliases = {}
    for name, t in state_dict.items():
        if t.numel() == 0 or t.device.type == "meta":
            continue
        identity = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if identity in seen:
            aliases[name] = seen[identity]
        else:
            seen[identity] = name
    return aliases


def _with_checkpoint_entries(ckpt: Checkpoint, module: nn.Module) -> Checkpoint:
    """Let submodules that store their weights in another form (quantized modules) name their entries.

    A submodule with a `checkpoint_entries()` method returns its entries by local name
    ({"weight": QuantizedTensor, "bias": LazyTensor}); they replace all of that submodule's own
    state_dict keys (packed data, scales, ...), at the place of its first key.
    """
    exported: dict[str, dict[str, TensorEntry]] = {}
    for prefix, sub in module.named_modules():
        export = getattr(sub, "checkpoint_entries", None)
        if callable(export):
            dot = f"{prefix}." if prefix else ""
            exported[dot] = {dot + name: entry for name, entry in export().items()}
    if not exported:
        return ckpt
    tensors: dict[str, TensorEntry] = {}
    owned: dict[str, list[str]] = {}                 # submodule prefix -> its own state_dict keys
    for name, entry in ckpt.tensors.items():
        owner = max((p for p in exported if name.startswith(p) and "." not in name[len(p):]), key=len, default=None)
        if owner is None:
            tensors[name] = entry
            continue
        if owner not in owned:                       # emitted once, where the submodule's first key was
            tensors.update(exported[owner])
        owned.setdefault(owner, []).append(name)
    metadata = dict(ckpt.metadata)
    if ALIASES_KEY in metadata:
        old = json.loads(metadata.pop(ALIASES_KEY))
        aliases = {a: t for a, t in old.items() if a in tensors and t in tensors}
        aliases |= _tied_submodules(old, owned, exported)
        if aliases:
            metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    return Checkpoint(tensors, metadata, ckpt.arch, ckpt.assets)


def _tied_submodules(aliases: Mapping[str, str], owned: Mapping[str, list[str]],
                     exported: Mapping[str, dict[str, TensorEntry]]) -> dict[str, str]:
    """Ties between submodules that name their own entries: where every state_dict key of one (a quantized
    output head's packed data and scales) is the same memory as the same key of another (the embedding
    table's), their entries are tied too ("lm_head.weight" -> "model.embed_tokens.weight"), so a writer
    stores the table once and a reader gives the head back on it."""
    ties: dict[str, str] = {}
    for head, keys in owned.items():
        tables = {aliases[k][:-len(k) + len(head)] if k in aliases else None for k in keys}
        table = tables.pop() if len(tables) == 1 else None
        if table is None or table == head or table not in exported \
                or any(aliases[k] != table + k[len(head):] for k in keys):
            continue
        ties |= {name: table + name[len(head):] for name in exported[head] if table + name[len(head):] in exported[table]}
    return ties


@dataclass
class Checkpoint:
    """What every converter reads and writes: named tensors read on demand, str metadata, an ArchSpec.

    Example:
        >>> from modelkit.models import build
        >>> ckpt = Checkpoint.from_module(build("mlp", seed=0))
        >>> ckpt.arch.name, ckpt.num_parameters
        ('mlp', 752)
    """

    tensors: Mapping[str, TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)
    arch: ArchSpec | None = None
    # Files that travel with the weights, by file name: a Hugging Face folder's tokenizer.json,
    # tokenizer_config.json, special_tokens_map.json, generation_config.json, tokenizer.model.
    assets: Mapping[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [k for k, v in self.metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise ConfigError(f"checkpoint metadata must map str to str; bad entry {bad[0]!r}")
        bad = [k for k, v in self.assets.items() if not isinstance(k, str) or not isinstance(v, bytes)]
        if bad:
            raise ConfigError(f"checkpoint assets must map file names to bytes; bad entry {bad[0]!r}")

    @classmethod
    def from_state_dict(
        cls, state_dict: Mapping[str, torch.Tensor], *, arch: ArchSpec | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Checkpoint:
        metadata = dict(metadata or {})
        aliases = _tied_names(state_dict)
        if aliases:
            metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
        return cls({name: LazyTensor.of(t, source=name) for name, t in state_dict.items()}, metadata, arch)

    @classmethod
    def from_module(
        cls, module: nn.Module, *, arch: ArchSpec | None = None, metadata: Mapping[str, str] | None = None,
    ) -> Checkpoint:
        """Wrap a module's state_dict; the ArchSpec of a reference model or of a transformers model of a
        registered family is filled in automatically."""
        if arch is None and (getattr(type(module), "arch", None) or models.hf_config_of(module) is not None):
            arch = models.arch_spec(module)
        ckpt = cls.from_state_dict(module.state_dict(), arch=arch, metadata=metadata)
        return _with_checkpoint_entries(ckpt, module)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def num_parameters(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def metrics(self) -> dict[str, Any]:
        """Evaluation figures stored by `modelkit train` (empty when none)."""
        try:
            value = json.loads(self.metadata.get(METRICS_KEY, "{}"))
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}

    def materialize(self) -> dict[str, torch.Tensor]:
        """Read every tensor as torch (dequantized): for small models and tests, never inside a converter."""
        return {name: t.load() for name, t in self.tensors.items()}


# Quantized layers live in the quantizers layer, above this one: reached through this lazy path
# (as storage.tensors.LAYOUT_MODULES reaches dequantizers), never imported here.
QUANTIZED_REBUILDER = "modelkit.quantizers._modules:rebuild"


def _build(ckpt: Checkpoint, arch: ArchSpec | str | None, source: str, target: str) -> tuple[nn.Module, str]:
    """The bare module: a user factory, or a registered model from `arch` / the file's ArchSpec."""
    if isinstance(arch, str) and ":" in arch:
        return build_factory(arch), arch
    if isinstance(arch, str):
        arch = ArchSpec(arch, ckpt.arch.config if ckpt.arch and ckpt.arch.name == arch else {})
    spec = arch or ckpt.arch
    if spec is None:
        raise UnsupportedConversionError(
            source, target,
            f"the file names no architecture; pass --arch NAME (one of {', '.join(models.MODELS)}) "
            "or --arch pkg.module:factory (API: arch=...)",
        )
    info = models.MODELS.get(spec.name)
    if info is None or not info.topology:
        return models.build_from_spec(spec), spec.name
    try:                                # a model built from the file's own topology: its errors name the file
        return models.build_from_spec(spec), spec.name
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from e


def build_factory(reference: str) -> nn.Module:
    """Call the user's factory "module:function" (or "module:Class") and check it made an nn.Module."""
    from torch import nn

    module = models.load_factory(reference)()
    if not isinstance(module, nn.Module):
        raise ConfigError(f"--arch {reference!r} returned a {type(module).__name__}, not a torch.nn.Module")
    return module


def _quantized_layers(model: nn.Module, quantized: Mapping[str, QuantizedTensor], source: str) -> nn.Module:
    import importlib

    module, _, function = QUANTIZED_REBUILDER.partition(":")
    return getattr(importlib.import_module(module), function)(model, dict(quantized), source=source)


def instantiate(ckpt: Checkpoint, *, arch: ArchSpec | str | None = None, source: str = "checkpoint",
                target: str = "a runnable model", dequantize: bool = False) -> nn.Module:
    """Rebuild a runnable module from a checkpoint: its ArchSpec (or `arch`) plus its weights.

    The one rebuilder of modelkit: files, exports and verifications all come through here.
    Quantized tensors become quantized layers holding them as stored (nothing is re-quantized),
    unless `dequantize`, which loads their float values into the float model (what graph
    exporters trace).

    Args:
        ckpt: The weights (and usually the ArchSpec).
        arch: Overrides the file: an ArchSpec, a registered model name (the file's config is kept
            when it names the same model), or a user factory "pkg.module:function".
        source, target: Names for error messages ("m.safetensors", "onnx").
        dequantize: Build the float model even when the checkpoint holds quantized tensors.

    Raises:
        UnsupportedConversionError: no architecture is known.
        ConfigError: the weights do not fit the architecture.
    """
    model, label = _build(ckpt, arch, source, target)
    quantized = {} if dequantize else {n: t for n, t in ckpt.tensors.items() if isinstance(t, QuantizedTensor)}
    if quantized:
        # An output head tied to a quantized table (a GGUF without output.weight: llama.cpp computes the
        # logits with token_embd) becomes a quantized layer holding that same tensor.
        tied_quantized = {alias: target for alias, target in _tied_names(model.state_dict()).items()
                          if target in quantized and alias not in ckpt.tensors}
        quantized |= {alias: quantized[target] for alias, target in tied_quantized.items()}
        model = _quantized_layers(model, quantized, source)
        for alias, target in tied_quantized.items():           # one copy of the table's parts in memory
            head, table = (model.get_submodule(name.rpartition(".")[0]) for name in (alias, target))
            for part in table.part_names:
                setattr(head, part, getattr(table, part))
    state = {n: t.load() for n, t in ckpt.tensors.items() if n not in quantized}
    expected = model.state_dict()
    # A quantized layer's own keys (packed data, scales) come from its QuantizedTensor, its bias from the file.
    owners = {n.rpartition(".")[0] for n in quantized}
    wanted = {k for k in expected if k.rpartition(".")[0] not in owners or k.rpartition(".")[2] == "bias"}
    # Weights the module ties to another (transformers' tied output head) come with their target:
    # a Hugging Face folder stores them once.
    tied = {alias for alias, target in _tied_names(expected).items() if alias not in state and target in state}
    wanted -= tied
    missing, unexpected = sorted(wanted - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ConfigError(
            f"{source}: weights do not fit architecture {label!r}"
            + (f"; missing {missing[:3]}" if missing else "") + (f"; unexpected {unexpected[:3]}" if unexpected else "")
        )
    wrong = [k for k in state if tuple(expected[k].shape) != tuple(state[k].shape)]
    if wrong:
        raise ConfigError(f"{source}: weights do not fit architecture {label!r}; {wrong[0]} is "
                          f"{list(state[wrong[0]].shape)}, the model expects {list(expected[wrong[0]].shape)}")
    model.load_state_dict(state, strict=not (quantized or tied))
    return model.eval()
