"""modelkit: move trained models between formats safely, make them smaller, check untrusted files.

Public names resolve on first use (PEP 562), so `import modelkit` stays light: it imports
neither torch nor onnx until a function that needs them is called.

Example:
    >>> import modelkit
    >>> ckpt = modelkit.load("runs/cnn/model.safetensors")      # doctest: +SKIP
    >>> modelkit.inspect("runs/cnn/model.safetensors").format   # doctest: +SKIP
    'safetensors'
"""
from __future__ import annotations

import importlib

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing (start-up time of `modelkit scan`)
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"

# public name -> "module:attribute"
_LAZY = {
    "load": "modelkit.api:load",
    "save": "modelkit.api:save",
    "load_module": "modelkit.api:load_module",
    "inspect": "modelkit.api:inspect",
    "complete": "modelkit.api:complete",
    "evaluate": "modelkit.api:evaluate",
    "generate": "modelkit.api:generate",
    "serve": "modelkit.pipeline.serve:serve",
    "convert": "modelkit.pipeline.convert:convert",
    "export": "modelkit.pipeline.convert:export",
    "ConversionReport": "modelkit.pipeline.convert:ConversionReport",
    "train": "modelkit.pipeline.train:train",
    "TrainConfig": "modelkit.pipeline.train:TrainConfig",
    "Checkpoint": "modelkit.checkpoint:Checkpoint",
    "ArchSpec": "modelkit.checkpoint:ArchSpec",
    "LazyTensor": "modelkit.checkpoint:LazyTensor",
    "QuantizedTensor": "modelkit.checkpoint:QuantizedTensor",
    "FORMATS": "modelkit.formats:FORMATS",
    "detect_format": "modelkit.formats:detect_format",
    "MODELS": "modelkit.models:MODELS",
    "build": "modelkit.models:build",
    "assert_same_outputs": "modelkit.testing:assert_same_outputs",
    "compare_outputs": "modelkit.testing:compare_outputs",
    "quantize": "modelkit.pipeline.quantize:quantize",
    "prepare_qat": "modelkit.pipeline.quantize:prepare_qat",
    "convert_qat": "modelkit.pipeline.quantize:convert_qat",
    "QuantizeReport": "modelkit.pipeline.reports:QuantizeReport",
    "SCHEMES": "modelkit.schemes:SCHEMES",
    "Int8Config": "modelkit.quantizers.int8:Int8Config",
    "Int8DynamicConfig": "modelkit.quantizers.int8_dynamic:Int8DynamicConfig",
    "Int4Config": "modelkit.quantizers.int4:Int4Config",
    "GPTQConfig": "modelkit.quantizers.gptq:GPTQConfig",
    "scan": "modelkit.scan:_PACKAGE",  # the callable package itself: modelkit.scan(path) (modelkit/scan/__init__.py)
    "Severity": "modelkit.scan:Severity", "Finding": "modelkit.scan:Finding", "ScanReport": "modelkit.scan:ScanReport",
}
_ERRORS = ("ModelkitError", "UnknownFormatError", "UnknownModelError", "FormatError", "UnsupportedConversionError",
           "MissingDependencyError", "ConfigError", "OutputExistsError", "UnsafeFileError", "VerificationError")
_LAZY.update({name: f"modelkit.errors:{name}" for name in _ERRORS})

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'modelkit' has no attribute {name!r}")
    module_name, attribute = target.split(":")
    value = getattr(importlib.import_module(module_name), attribute)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
