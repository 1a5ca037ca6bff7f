"""The reference models ("the zoo") and the registry every model plugs into.

A model is ONE module that declares everything the commands need of it; converters, quantizers
and the pipeline look the facts up here and never name a model themselves. The names each module
defines (`modelkit.models.plugin.PLUGIN_NAMES`, checked when the module is first loaded):

- ``CONFIG``: a frozen dataclass of primitive fields (the ArchSpec's ``config``)
- ``MODEL``: the nn.Module class; ``MODEL(config)`` builds it, ``MODEL.arch`` is its registered name
- ``TASK``: data splits, loss and metrics (``modelkit.models._tasks``)
- ``TRAINING``: the default recipe (epochs, batch size, learning rate, ...)
- ``example_inputs(batch_size)``: a batch shaped like real inputs, for export and checks
- ``keras_layers(config)``, ``onnx_axes(config)``, ``prune_groups(config)``, ``DISTILL``, ``STUDENT``,
  ``QUALITY``, ``GGUF``: the per-model facts of the HDF5/Keras and ONNX converters, structured
  pruning, distillation, `modelkit demo` and the GGUF converter, as plain data
  (``modelkit.models.plugin`` has the types and says what each means)

Models come from three places, all lazily (nothing is imported until a model is used):
the zoo below; packages that declare an entry point in the group ``modelkit.models``
(``name = "package.module"``, read with importlib.metadata on the first registry lookup, so
`import modelkit` and `modelkit scan` never pay for it); and `register_model` (tests, embedding).
A name is registered once: a second registration raises. Files only ever name registered models.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from modelkit.errors import ConfigError, FormatError, UnknownModelError, did_you_mean
from modelkit.metadata import ARCH_KEY
from modelkit.models.plugin import PLUGIN_NAMES, HFFamily, hf_plugin_defaults

if TYPE_CHECKING:
    from torch import nn

_PRIMITIVES = (str, int, float, bool, type(None))
ENTRY_POINT_GROUP = "modelkit.models"


@dataclass(frozen=True)
class ModelInfo:
    name: str          # the ArchSpec name and the CLI's `modelkit train NAME`
    module: str        # imported on first use
    summary: str
    hf: bool = False   # a Hugging Face family (declares FAMILY: built by transformers, nothing to train)
    topology: bool = False   # built from a file's own topology (keras: a TF.js / Keras model config), nothing to train


_ZOO = (
    ModelInfo("cnn", "modelkit.models.cnn", "small conv net on the 8x8 handwritten digits (UCI optical digits)"),
    ModelInfo("mlp", "modelkit.models.mlp", "Linear-ReLU-Linear-ReLU-Linear on two interleaved 2-D spirals"),
    ModelInfo("tinylm", "modelkit.models.tinylm", "byte-level Llama decoder trained on the Python standard library"),
)
# Hugging Face families: a save_pretrained folder's config.json `model_type` picks one (family_for_config).
_FAMILIES = tuple(ModelInfo(name, f"modelkit.models.{name}", summary, hf=True) for name, summary in (
    ("gemma2", "Hugging Face Gemma 2 (Gemma2ForCausalLM; llama.cpp gemma2)"),
    ("gemma3", "Hugging Face Gemma 3 language model (Gemma3ForCausalLM; llama.cpp gemma3)"),
    ("gpt2", "Hugging Face GPT-2 (GPT2LMHeadModel; llama.cpp gpt2)"),
    ("llama", "Hugging Face Llama (LlamaForCausalLM; llama.cpp llama), Llama-3 rope scaling included"),
    ("mistral", "Hugging Face Mistral (MistralForCausalLM; llama.cpp llama)"),
    ("phi3", "Hugging Face Phi-3 (Phi3ForCausalLM; llama.cpp phi3)"),
    ("qwen2", "Hugging Face Qwen2 (Qwen2ForCausalLM; llama.cpp qwen2)"),
    ("qwen3", "Hugging Face Qwen3 (Qwen3ForCausalLM; llama.cpp qwen3)"),
))


class _Registry(Mapping[str, ModelInfo]):
    """Registered name -> ModelInfo: the zoo, then entry points (read on the first lookup), then
    `register_model` calls. Reads like a dict; only `register_model`/`unregister_model` change it."""

    def __init__(self, zoo: tuple[ModelInfo, ...]) -> None:
        self._infos = {m.name: m for m in zoo}
        self._modules: dict[str, ModuleType] = {}      # loaded and checked
        self._entry_points_read = False
        self._lock = threading.Lock()

    def _entry_points(self) -> None:
        if self._entry_points_read:
            return
        with self._lock:
            if self._entry_points_read:
                return
            from importlib.metadata import entry_points

            found = [ModelInfo(ep.name, ep.value, f"from the {ep.dist.name if ep.dist else '?'} package")
                     for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)]
            before = dict(self._infos)
            try:
                for info in found:
                    self._add(info)
            except ConfigError:
                self._infos = before            # all of them or none: the next lookup raises the same error
                raise
            self._entry_points_read = True

    def _add(self, info: ModelInfo) -> None:
        if not info.name or not isinstance(info.name, str):
            raise ConfigError(f"a model name must be a non-empty string, got {info.name!r}")
        if info.name in self._infos:
            raise ConfigError(f"model {info.name!r} is registered twice ({self._infos[info.name].module} "
                              f"and {info.module}); pick another name")
        self._infos[info.name] = info

    def __getitem__(self, name: str) -> ModelInfo:
        self._entry_points()
        return self._infos[name]

    def __iter__(self) -> Iterator[str]:
        self._entry_points()
        return iter(dict(self._infos))

    def __len__(self) -> int:
        self._entry_points()
        return len(self._infos)

    def __contains__(self, name: object) -> bool:
        self._entry_points()
        return name in self._infos


# Models whose ArchSpec is a file's own topology (plain data from a closed table of layer classes, never code).
_TOPOLOGIES = (ModelInfo("keras", "modelkit.models.keras_graph",
                         "a Keras Sequential or functional model as a TF.js model.json or Keras JSON describes it",
                         topology=True),)

MODELS = _Registry(_ZOO + _FAMILIES + _TOPOLOGIES)


def register_model(name: str, module: str | ModuleType, *, summary: str = "") -> None:
    """Add a model: `module` (a dotted path, imported on first use, or a module object) declares its
    plugin names (see this package's docstring).

    Raises:
        ConfigError: `name` is registered already (entry points included), or is empty.

    Example:
        >>> register_model("mymodel", "mypackage.mymodel", summary="what it is")   # doctest: +SKIP
    """
    MODELS._entry_points()
    path = module if isinstance(module, str) else module.__name__
    checked = _checked(name, module) if isinstance(module, ModuleType) else None
    with MODELS._lock:
        MODELS._add(ModelInfo(name, path, summary))
        if checked is not None:
            MODELS._modules[name] = checked


def unregister_model(name: str) -> None:
    """Remove a model `register_model` added (tests restore the registry with it in `finally`)."""
    MODELS._entry_points()
    with MODELS._lock:
        if name not in MODELS._infos:
            raise UnknownModelError(name, known=MODELS._infos)
        if any(m.name == name for m in _ZOO):
            raise ConfigError(f"{name!r} is one of modelkit's own models and stays registered")
        del MODELS._infos[name]
        MODELS._modules.pop(name, None)


def _checked(name: str, module: ModuleType) -> ModuleType:
    family = getattr(module, "FAMILY", None)
    if family is not None:
        if not isinstance(family, HFFamily):
            raise ConfigError(f"model {name!r}: {module.__name__}.FAMILY must be a modelkit.models.plugin.HFFamily")
        from modelkit.models import _hf_prune

        defaults = {**hf_plugin_defaults(), "prune_groups": functools.partial(_hf_prune.prune_groups, family)}
        for attribute, default in defaults.items():     # what the zoo's commands look up
            if not hasattr(module, attribute):
                setattr(module, attribute, default)
        return module
    missing = [n for n in PLUGIN_NAMES if not hasattr(module, n)]
    if missing:
        raise ConfigError(f"model {name!r} ({module.__name__}) does not define {', '.join(missing)}; "
                          "a model module defines all of modelkit.models.plugin.PLUGIN_NAMES (None where it has none)")
    if getattr(module.MODEL, "arch", None) != name:
        raise ConfigError(f"model {name!r}: {module.__name__}.MODEL.arch is {getattr(module.MODEL, 'arch', None)!r}, "
                          f"not {name!r}")
    return module


def _is_primitive_tree(value: Any) -> bool:
    if isinstance(value, _PRIMITIVES):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_primitive_tree(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_primitive_tree(v) for k, v in value.items())
    return False


@dataclass(frozen=True)
class ArchSpec:
    """How to rebuild the nn.Module that owns these weights.

    `name` is a key of modelkit.models.MODELS; `config` its constructor arguments (widths,
    layers, vocab...), so pruned or distilled variants rebuild too. A spec read from a file
    only ever names a registered model: nothing from a file decides what code is imported.
    """

    name: str
    config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"ArchSpec name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.config, dict) or not _is_primitive_tree(self.config):
            raise ConfigError(f"ArchSpec config for {self.name!r} must be a dict of JSON values")

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "config": self.config}, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, *, source: str | Path = "<metadata>") -> ArchSpec:
        """Parse a spec stored in a file; refuse anything but a registered model name."""
        try:
            raw = json.loads(text)
        except (json.JSONDecodeError, TypeError, RecursionError) as e:     # RecursionError: nested too deep
            raise FormatError(source, f"the {ARCH_KEY} entry is not valid JSON ({e})") from e
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not isinstance(raw.get("config", {}), dict):
            raise FormatError(source, f'the {ARCH_KEY} entry must look like {{"name": ..., "config": {{...}}}}')
        if raw["name"] not in MODELS:
            raise FormatError(
                source,
                f"names architecture {raw['name']!r}, which is not a registered model "
                f"(known: {', '.join(MODELS)}); pass --arch to choose one",
            )
        try:
            return cls(raw["name"], raw.get("config", {}))
        except ConfigError as e:
            raise FormatError(source, str(e)) from e


def load_model_module(name: str) -> ModuleType:
    """Import and return the module of the registered model `name`."""
    module = MODELS._modules.get(name)
    if module is not None:
        return module
    info = MODELS.get(name)
    if info is None:
        raise UnknownModelError(name, known=MODELS)
    try:
        imported = importlib.import_module(info.module)
    except ImportError as e:
        hint = "; pip install 'modelkit[torch]'" if (getattr(e, "name", None) or "").startswith("torch") else ""
        raise ConfigError(f"model {name!r}: cannot import its module {info.module} ({e}){hint}") from e
    module = MODELS._modules[name] = _checked(name, imported)
    return module


def config_from_dict(name: str, values: Mapping[str, Any] | None = None) -> Any:
    """Build model `name`'s config dataclass from plain values (unknown keys are an error)."""
    module = load_model_module(name)
    if getattr(module, "FAMILY", None) is not None:       # a Hugging Face family: the config.json dict itself
        return dict(values or {})
    config_cls = module.CONFIG
    values = dict(values or {})
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(
            f"{name}: unknown config key {unknown[0]!r}{did_you_mean(unknown[0], fields)}; "
            f"known: {', '.join(sorted(fields))}"
        )
    try:
        return config_cls(**values)
    except TypeError as e:
        raise ConfigError(f"{name}: bad config value ({e})") from e


def config_to_dict(config: Any) -> dict[str, Any]:
    """A config dataclass as JSON-ready values (tuples become lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


def build(name: str, config: Mapping[str, Any] | None = None, *, seed: int | None = None) -> nn.Module:
    """Build a fresh, untrained reference model.

    Args:
        name: A key of MODELS: "mlp", "cnn" or "tinylm".
        config: Constructor values that differ from the defaults, e.g. {"hidden": [64, 32]}.
        seed: Seeds torch's generator first, so the initial weights are reproducible.

    Example:
        >>> from modelkit.models import build
        >>> model = build("mlp", seed=0)
        >>> model.net[0].weight.shape
        torch.Size([30, 2])
    """
    module = load_model_module(name)
    cfg = config_from_dict(name, config)
    if seed is not None:
        import torch

        torch.manual_seed(seed)
    if getattr(module, "FAMILY", None) is not None:
        from modelkit.models import _hf

        return _hf.build(module.FAMILY, cfg)
    return module.MODEL(cfg)


def hf_config_of(model: Any) -> dict[str, Any] | None:
    """A transformers model's config as its save_pretrained folder's config.json holds it, or None for any
    other module (duck-typed: transformers is not imported here)."""
    config = getattr(model, "config", None)
    if not isinstance(getattr(config, "model_type", None), str) or not callable(getattr(config, "to_json_string", None)):
        return None
    values = json.loads(config.to_json_string(use_diff=True))
    values.pop("transformers_version", None)
    values.setdefault("model_type", config.model_type)
    return values


def arch_spec(model: nn.Module) -> ArchSpec:
    """The ArchSpec that rebuilds `model`: a reference model built by `build`, or a transformers model of a
    registered Hugging Face family (ArchSpec(family, its config.json values))."""
    hf_config = hf_config_of(model)
    if hf_config is not None:
        return ArchSpec(family_for_config(hf_config, source=type(model).__name__), hf_config)
    name = getattr(type(model), "arch", None)
    if name not in MODELS:
        raise ConfigError(f"{type(model).__name__} is not a registered reference model; known: {', '.join(MODELS)}")
    return ArchSpec(name, config_to_dict(model.config))


def build_from_spec(spec: ArchSpec) -> nn.Module:
    """Build the (untrained) module an ArchSpec names."""
    return build(spec.name, spec.config)


def load_factory(reference: str) -> Callable[[], nn.Module]:
    """Import a user's model factory named on the command line or in the API: "module:function" or
    "module:Class" (any callable taking no arguments that returns the nn.Module).

    The module is imported as `python -c "import module"` would: the current directory comes first
    on the search path (for that import only), so `--arch user_model:make` finds ./user_model.py.
    Never called with a name read from a file: files may only name registered models.
    """
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"--arch {reference!r}: expected a registered model ({', '.join(MODELS)}) "
                          "or a factory as module:function (or module:Class)")
    try:
        with _current_directory_first():
            factory = importlib.import_module(module_name)
        for part in attribute.split("."):          # "module:Outer.make" reaches a nested attribute
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--arch {reference!r}: cannot import it ({e}); the module is looked up in the "
                          f"current directory ({Path.cwd()}) and on sys.path") from e
    if not callable(factory):
        raise ConfigError(f"--arch {reference!r} is not callable")
    return factory


@contextlib.contextmanager
def _current_directory_first() -> Iterator[None]:
    """The current directory at the front of sys.path during an import, as Python puts it there for
    `python -c` and `python -m` (a console script gets its own folder instead); removed afterwards,
    so it shadows nothing imported later."""
    importlib.invalidate_caches()              # a module file written since the last import is seen
    cwd = str(Path.cwd())
    if sys.path and sys.path[0] in ("", cwd):
        yield
        return
    sys.path.insert(0, cwd)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(cwd)


def zoo_models() -> list[str]:
    """Registered models modelkit builds and trains itself (the zoo and plugins), without the Hugging Face families."""
    return sorted(name for name, info in MODELS.items() if not info.hf and not info.topology)


def hf_family(name: str) -> HFFamily | None:
    """The HFFamily registered model `name` declares, or None (a zoo model, or not registered)."""
    info = MODELS.get(name)
    return getattr(load_model_module(name), "FAMILY", None) if info is not None and info.hf else None


def hf_families() -> dict[str, HFFamily]:
    """Every registered Hugging Face family by name (the family modules are plain data: no torch)."""
    return {name: load_model_module(name).FAMILY for name, info in MODELS.items() if info.hf}


def family_for_config(config: Mapping[str, Any], *, source: str | Path = "config.json") -> str:
    """The registered family whose `model_types` hold config.json's `model_type`.

    Raises:
        UnknownModelError: no family knows the model_type (the message names it and the known families).
    """
    model_type = config.get("model_type")
    families = hf_families()
    for name, family in families.items():
        if model_type in family.model_types:
            return name
    known = sorted(t for f in families.values() for t in f.model_types)
    listing = ", ".join(f"{n} ({'/'.join(f.model_types)})" for n, f in sorted(families.items()))
    raise UnknownModelError(str(model_type), known=known, message=(
        f"{source}: model_type {model_type!r} is not a family modelkit knows; known families: {listing}"))


def gguf_conventions(spec: ArchSpec | None) -> Any:
    """How llama.cpp stores the model `spec` names (modelkit.models._hf.Conventions), or None when it
    follows no llama.cpp architecture: a Hugging Face family, or a zoo model whose GGUF layout names one
    (tinylm: llama's table, with its byte vocabulary)."""
    if spec is None or spec.name not in MODELS:
        return None
    from modelkit.models import _hf

    family = hf_family(spec.name)
    if family is not None:
        return _hf.conventions(spec.name, family, spec.config)
    layout = getattr(load_model_module(spec.name), "GGUF", None)
    family = hf_family(layout.architecture) if layout is not None else None
    if family is None:
        return None
    config = config_to_dict(config_from_dict(spec.name, spec.config))
    return dataclasses.replace(_hf.conventions(layout.architecture, family, config), tokenizer=layout.tokenizer,
                               bos_id=layout.bos_id, eos_id=layout.eos_id)
