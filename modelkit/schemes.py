"""The scheme table: the only place that lists quantization schemes, and their configs' JSON form.

Each entry names a config class by a dotted path imported on first use; next to the class, its
module defines `apply(model, config) -> new model`. `config_from_dict` looks a scheme up here
and nowhere else: a name read from a file can only ever pick one of these entries, and nothing
from a file is imported (the allowlist torchao keeps in ALLOWED_AO_MODULES, as a table).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from modelkit.errors import ConfigError, MissingDependencyError, did_you_mean

# scheme name -> "module:ConfigClass"; sorted, one line each.
SCHEMES: dict[str, str] = {
    "bf16": "modelkit.quantizers.cast:Bf16Config",
    "fp16": "modelkit.quantizers.cast:Fp16Config",
    "gptq": "modelkit.quantizers.gptq:GPTQConfig",
    "int4": "modelkit.quantizers.int4:Int4Config",
    "int8": "modelkit.quantizers.int8:Int8Config",
    "int8-dynamic": "modelkit.quantizers.int8_dynamic:Int8DynamicConfig",
    "iq4_nl": "modelkit.quantizers.gguf_arrays:IQ4_NLConfig",
    "iq4_xs": "modelkit.quantizers.gguf_arrays:IQ4_XSConfig",
    "q2_k": "modelkit.quantizers.gguf_arrays:Q2_KConfig",           # llama.cpp's Q2_K file type (a recipe)
    "q3_k": "modelkit.quantizers.gguf_arrays:Q3_KConfig",
    "q3_k_l": "modelkit.quantizers.gguf_arrays:Q3_K_LConfig",
    "q3_k_m": "modelkit.quantizers.gguf_arrays:Q3_K_MConfig",
    "q3_k_s": "modelkit.quantizers.gguf_arrays:Q3_K_SConfig",
    "q4_0": "modelkit.quantizers.gguf_arrays:Q4_0Config",
    "q4_1": "modelkit.quantizers.gguf_arrays:Q4_1Config",
    "q4_k": "modelkit.quantizers.gguf_arrays:Q4_KConfig",
    "q4_k_m": "modelkit.quantizers.gguf_arrays:Q4_K_MConfig",
    "q4_k_s": "modelkit.quantizers.gguf_arrays:Q4_K_SConfig",
    "q5_0": "modelkit.quantizers.gguf_arrays:Q5_0Config",
    "q5_1": "modelkit.quantizers.gguf_arrays:Q5_1Config",
    "q5_k": "modelkit.quantizers.gguf_arrays:Q5_KConfig",
    "q5_k_m": "modelkit.quantizers.gguf_arrays:Q5_K_MConfig",
    "q5_k_s": "modelkit.quantizers.gguf_arrays:Q5_K_SConfig",
    "q6_k": "modelkit.quantizers.gguf_arrays:Q6_KConfig",           # llama.cpp's Q6_K file type (a recipe)
    "q8_0": "modelkit.quantizers.gguf_arrays:Q8_0Config",
    "tfjs-uint16": "modelkit.quantizers.tfjs_uint:TfjsUint16Config",
    "tfjs-uint8": "modelkit.quantizers.tfjs_uint:TfjsUint8Config",
}

# Schemes for ONNX models, run by onnxruntime's own quantization tools (modelkit.pipeline.onnx_quantize).
ONNX_SCHEMES: tuple[str, ...] = ("int4", "int8-dynamic", "int8-static")

SCHEME_KEY = "scheme"


def _check(name: str) -> str:
    """The scheme's name as the table spells it; GGUF block types and llama.cpp's file types in any case
    ("Q4_K_M", as llama-quantize takes them)."""
    if isinstance(name, str) and name not in SCHEMES and name.lower() in SCHEMES and name.lower().startswith("q"):
        name = name.lower()
    if not isinstance(name, str) or name not in SCHEMES:
        raise ConfigError(f"unknown quantization scheme {name!r}; known: {', '.join(SCHEMES)}"
                          f"{did_you_mean(str(name), SCHEMES)}")
    return name


def _import(name: str, module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if (e.name or "").startswith("modelkit"):
            raise
        extra = " (pip install 'modelkit[torch]')" if (e.name or "").startswith("torch") else ""
        raise MissingDependencyError(f"scheme {name!r} needs the {e.name!r} package{extra}") from e


def scheme_module(name: str) -> ModuleType:
    """Import and return the quantizer module of scheme `name`: the one that defines `apply`, which is
    the config's own module unless that module names another in APPLY_MODULE (a torch-free home for
    configs whose `apply` needs torch)."""
    module = _import(name, SCHEMES[_check(name)].split(":")[0])
    target = getattr(module, "APPLY_MODULE", None)
    return _import(name, target) if target else module


def load_scheme(name: str) -> type:
    """The config class of scheme `name` (importing its module only, never an APPLY_MODULE).

    Example:
        >>> load_scheme("int4")(group_size=64).group_size
        64
    """
    module_name, _, class_name = SCHEMES[_check(name)].partition(":")
    return getattr(_import(name, module_name), class_name)


def config_to_dict(config: Any) -> dict[str, Any]:
    """A config as JSON-ready values with its scheme name: {"scheme": "int4", "group_size": 32, ...}."""
    scheme = getattr(type(config), "scheme", None)
    if scheme not in SCHEMES or not dataclasses.is_dataclass(config) or load_scheme(scheme) is not type(config):
        raise ConfigError(f"{type(config).__name__} is not the config of a registered scheme ({', '.join(SCHEMES)})")
    # an optional field left unset (None by default, e.g. a GGUF scheme's imatrix) is left out: the JSON
    # (and the files that record it) stay as they were before the field existed
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if not (f.default is None and getattr(config, f.name) is None)}
    return {SCHEME_KEY: scheme, **{k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}}


def config_from_dict(values: Mapping[str, Any]) -> Any:
    """Rebuild a config from `config_to_dict`'s output (or JSON written by hand).

    Raises:
        ConfigError: no or unknown scheme, unknown keys (with "did you mean"), bad values.

    Example:
        >>> config_from_dict({"scheme": "int4", "group_size": 64})
        Int4Config(group_size=64, symmetric=True, skip=())
    """
    if not isinstance(values, Mapping):
        raise ConfigError(f"a quantization config is a JSON object, got {type(values).__name__}")
    values = dict(values)
    cls = load_scheme(_check(values.pop(SCHEME_KEY, None)))
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"{cls.scheme}: unknown option {unknown[0]!r}{did_you_mean(unknown[0], fields)}; "
                          f"known: {', '.join(sorted(fields)) or '(none)'}")
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(f"{cls.scheme}: bad options ({e})") from e


def config_to_json(config: Any) -> str:
    return json.dumps(config_to_dict(config), sort_keys=True, separators=(",", ":"))


def config_from_json(text: str) -> Any:
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"quantization config is not valid JSON ({e})") from e
    return config_from_dict(values)


def apply(model: Any, config: Any) -> Any:
    """Quantize `model` with `config` through its scheme's `apply` (returns a new model)."""
    scheme = getattr(type(config), "scheme", None)
    return scheme_module(_check(scheme)).apply(model, config)
