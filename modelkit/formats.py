"""The format table: the only place that lists formats, and content-based detection.

Each entry names a converter module (imported on first use) with the same names:

    detect(path: Path) -> bool                      modelkit.parse.detect.<name>: a few KB, never unpickles
    read(path: Path, options: ReadOptions) -> Checkpoint
    write(ckpt: Checkpoint, path: Path, options: WriteOptions) -> None     (read_only formats: raises why not)
    runnable(path: Path, options: ReadOptions) -> Callable[..., Tensor]   graph formats only

`write` writes to `path` as given (the caller made it a temporary name and renames it after
verification); `options.final_path` is the name it will have.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from modelkit.errors import ConfigError, FormatError, MissingDependencyError, UnknownFormatError
from modelkit.parse import sniff


@dataclass(frozen=True)
class FormatInfo:
    name: str                      # CLI and error-message name: "safetensors"
    suffixes: tuple[str, ...]      # first one is the default when writing
    module: str                    # "modelkit.converters.safetensors", imported on first use
    extra: str | None = None       # pip extra that brings its dependencies
    has_graph: bool = False        # the file holds the computation, not only weights
    runs_pickle: bool = False      # loading unpickles: scan first, then weights_only=True
    companions: tuple[str, ...] = ()   # sidecar files a write may add: "<name><suffix>", "{stem}.bin" (atomic_path)
    folder: bool = False           # the output is a folder (a Hugging Face model folder): no suffix, --to names it;
                                   # with suffixes (tfjs), DIR/model.json names the folder DIR
    folder_file: str | None = None     # a folder format whose output may be named by its main file: DIR/model.json
    maps_module: bool = False      # the writer maps a user's module to a layout of its own (HDF5: Keras layers)
    keras_model: bool = False      # the file is a Keras model: only checkpoints with a Keras layout (mlp, cnn, a
                                   # user's Sequential) can be written; others raise UnsupportedConversionError
    read_only: bool = False        # read (inspect, scan, convert from) but never written: TensorFlow's, legacy ggml


FORMATS: dict[str, FormatInfo] = {f.name: f for f in (
    FormatInfo("ggml",        (".ggml", ".bin"),                 "modelkit.converters.ggml", read_only=True),
    FormatInfo("gguf",        (".gguf",),                        "modelkit.converters.gguf"),
    FormatInfo("hdf5",        (".h5", ".hdf5"),                  "modelkit.converters.hdf5", maps_module=True),
    FormatInfo("hf",          (),                                "modelkit.converters.hf", folder=True),
    FormatInfo("keras",       (".keras",),                       "modelkit.converters.keras", maps_module=True,
               keras_model=True),
    FormatInfo("npz",         (".npz",),                         "modelkit.converters.npz"),
    FormatInfo("onnx",        (".onnx",),                        "modelkit.converters.onnx", extra="onnx", has_graph=True,
               companions=(".data",)),
    FormatInfo("openvino",    (".xml",),                         "modelkit.converters.openvino", extra="openvino",
               has_graph=True, companions=("{stem}.bin",)),
    FormatInfo("pt2",         (".pt2",),                         "modelkit.converters.pt2", extra="torch", has_graph=True),
    FormatInfo("pth",         (".pt", ".pth", ".bin", ".ckpt"),  "modelkit.converters.pth", extra="torch", runs_pickle=True),
    FormatInfo("safetensors", (".safetensors",),                 "modelkit.converters.safetensors"),
    FormatInfo("savedmodel",  (".pb",),                          "modelkit.converters.savedmodel", folder=True,
               folder_file="saved_model.pb", read_only=True),
    FormatInfo("tfcheckpoint", (".index",),                      "modelkit.converters.tfcheckpoint", read_only=True),
    FormatInfo("tfjs",        (".json",),                        "modelkit.converters.tfjs", folder=True,
               folder_file="model.json", maps_module=True),
    FormatInfo("torchscript", (".ts", ".pt"),                    "modelkit.converters.torchscript", extra="torch", has_graph=True,
               runs_pickle=True),
)}

# The formats modelkit writes (the others are read_only).
WRITABLE: tuple[str, ...] = tuple(name for name, info in FORMATS.items() if not info.read_only)

# How a model file can be run for evaluation: torch rebuilds the module from the weights; onnxruntime
# runs an ONNX file's own graph in a session (eval and serve); openvino an OpenVINO IR in OpenVINO's runtime (eval).
RUNTIMES = ("torch", "onnxruntime")
EVAL_RUNTIMES = (*RUNTIMES, "openvino")


@dataclass(frozen=True, kw_only=True)
class ReadOptions:
    """How to read a file; each converter uses the fields that apply to its format.

    Args:
        trust: Allow content that runs code when loaded (whole-module pickles, TorchScript
            code). Content the scanner calls dangerous is refused even then.
        key: For checkpoints that nest several state_dicts ({"model": ..., "optimizer": ...}),
            the one to read.
        dequantize: For quantized files (GGUF block types), return float tensors instead of
            QuantizedTensors.
    """

    trust: bool = False
    key: str | None = None
    dequantize: bool = False


@dataclass(frozen=True, kw_only=True)
class WriteOptions:
    """How to write a file; each converter uses the fields that apply to its format.

    Args:
        module: Graph formats: the module to export (else rebuilt from the checkpoint's ArchSpec);
            formats that map modules (HDF5): a user's module to lay out (Keras layers).
        example_inputs: Graph formats: sample inputs for export, tracing and verification.
        input_names: ONNX: the graph's input names, one per example input (else the exporter's).
        dynamic_axes: ONNX: {input name: axes} left free; None: axis 0 of every input (and the
            axes the model declares).
        shard_size: safetensors, hf, tfjs: split into shards of at most this many bytes.
        final_path: The name the output gets after the atomic rename (for sidecar files).
        kv_cache: onnx, Hugging Face causal LMs: also take past_key_values.N.key/value inputs and
            return present.N.key/value, so a decode step runs with the cache (docs/formats/onnx.md).
    """

    module: Any = None
    example_inputs: tuple[Any, ...] | None = None
    input_names: tuple[str, ...] | None = None
    dynamic_axes: dict[str, tuple[int, ...]] | None = None
    shard_size: int | None = None
    final_path: Path | None = None
    kv_cache: bool = False


def load_format(name: str) -> ModuleType:
    """Import and return the converter module for `name`."""
    info = FORMATS.get(name)
    if info is None:
        raise UnknownFormatError(name, known=FORMATS)
    try:
        return importlib.import_module(info.module)
    except ModuleNotFoundError as e:
        if info.extra is None or (e.name or "").startswith("modelkit"):
            raise
        raise MissingDependencyError(     # the format's extra brings all it needs ([onnx] includes torch)
            f"format {name!r} needs the {e.name!r} package: pip install 'modelkit[{info.extra}]'"
        ) from e


def check_readable(path: Path) -> None:
    """One-line errors for the usual ways an input path is wrong."""
    if not path.exists():
        if Path(f"{path}.index").is_file():      # TensorFlow names checkpoints by their prefix
            raise FormatError(path, f"no such file or folder; for the TensorFlow checkpoint, name {path.name}.index")
        raise FormatError(path, "no such file or folder")
    if path.is_dir():
        return
    if not os.access(path, os.R_OK):
        raise FormatError(path, "permission denied")


def detect_format(path: str | os.PathLike[str]) -> str:
    """The name of the format `path` holds, decided by content; the suffix only breaks ties.

    Reads at most a few KB (and a zip directory); never unpickles.

    Raises:
        FormatError: the file is missing, or no known format matches; the message says what
            the file looks like and lists the known formats.
    """
    path = Path(path)
    check_readable(path)
    from modelkit.parse import detect  # the converters' own detectors, without importing the converters

    matches = [name for name in FORMATS if getattr(detect, name)(path)]
    if len(matches) > 1:  # e.g. a zip that two formats accept: prefer the one the suffix names
        by_suffix = [m for m in matches if path.suffix.lower() in FORMATS[m].suffixes]
        matches = by_suffix or matches
    if matches:
        return matches[0]
    seen = "a folder" if path.is_dir() else sniff.describe(sniff.read_head(path))
    raise FormatError(path, f"not a model file modelkit can read: it looks like {seen}; "
                            f"known formats: {', '.join(FORMATS)}")


def output_folder(path: str | os.PathLike[str], fmt: str) -> Path:
    """Where a folder format's output goes: `path` itself, or DIR for DIR/model.json (tfjs)."""
    path, info = Path(path), FORMATS[fmt]
    if info.folder_file is None or path.suffix.lower() not in info.suffixes:
        return path
    if path.name != info.folder_file:
        raise ConfigError(f"a {fmt} model is a folder whose file is {info.folder_file}: name the output "
                          f"DIR/{info.folder_file}, or DIR with --to {fmt}")
    if path.parent == Path(path.anchor) or str(path.parent) in ("", "."):
        raise ConfigError(f"a {fmt} model is a folder of its own: name it, as DIR/{info.folder_file} "
                          "(it is created, and replaced only with --force)")
    return path.parent


def format_for_output(path: str | os.PathLike[str], to: str | None = None, *, source: str | None = None) -> str:
    """The format to write: `to` if given (checked, with "did you mean"), else from the suffix; a path whose
    suffix names no format, when the input (`source`) is a folder format (a Hugging Face folder), is that format."""
    if to is not None:
        if to not in FORMATS:
            raise UnknownFormatError(to, known=FORMATS)
        return to
    suffix = Path(path).suffix.lower()
    for info in FORMATS.values():
        if suffix in info.suffixes:
            return info.name
    if source in FORMATS and FORMATS[source].folder:      # "out", "Llama-3.2-1B-int4": a folder like the input
        return source
    raise ConfigError(
        f"cannot tell the output format of {Path(path).name!r} from its suffix; "
        f"pass --to with one of: {', '.join(FORMATS)}"
    )
