"""pt2: a program exported by torch.export and saved by torch.export.save (the PT2 archive).

Spec: https://docs.pytorch.org/docs/stable/export.html; the archive is written by
torch/export/pt2_archive/_package.py (`package_pt2`) and its program JSON follows
torch/_export/serde/schema.py. modelkit.parse.pt2 gives the byte layout. torch 2.13 names torch.export the
successor of TorchScript; this is modelkit's recommended graph format from PyTorch to PyTorch.

What modelkit writes: `torch.export.export` of the module in eval mode with dynamic shapes (axis 0 of every
input, plus the axes a reference model declares, or the caller's `dynamic_axes`; a Hugging Face causal LM as
modelkit/testing/causal_lm.py's graph, input_ids/attention_mask/position_ids -> logits with batch and
sequence free), saved with `extra/modelkit.json`:
    {"format": "modelkit.pt2/1", "arch": ArchSpec JSON or null, "metadata": {str: str},
     "state_dict": [names in order], "prefix": where they are among the program's weights ("model." for a
     causal LM's graph), "inputs": [input names]}

Reading weights runs nothing and needs no torch: modelkit.parse.pt2 reads the program and payload JSON
and maps each raw weight and constant as a view of the file. Entries torch would unpickle (tensor
subclasses, custom and opaque objects) are not read. `runnable` is the one place that calls
torch.export.load, behind the scanner's gate (which refuses AOTInductor libraries, pickles that reach the
OS and graph targets outside torch's operators).
"""
from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelkit.checkpoint import ALIASES_KEY, ArchSpec, Checkpoint, LazyTensor
from modelkit.errors import FormatError, ParseError, UnsupportedConversionError
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.metadata import PT2_EXTRA
from modelkit.parse import pt2 as pt2_archive
from modelkit.parse.detect import pt2 as detect  # noqa: F401  (the converter's detect)
from modelkit.parse.torch_format import TensorRecord, tied_names
from modelkit.storage.dtypes import DTYPES
from modelkit.storage.mapped import FileSpan

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

EXTRA_NAME = PT2_EXTRA
_LAYOUT = "modelkit.pt2/1"
_EXTRA_LIMIT = 16 << 20


def _gate(path: Path, *, trust: bool) -> None:
    """The scanner's gate: dangerous content (AOTInductor libraries, pickles reaching the OS, graph targets
    outside torch's operators) is refused even with trust."""
    from modelkit.scan import gate

    gate(path, trust=trust)


# ---- reading weights without running anything -------------------------------------------------

def read(path: Path, options: ReadOptions = ReadOptions()) -> Checkpoint:
    """The program's weights (and, for archives modelkit did not write, its tensor constants) and modelkit's
    metadata, without torch and without unpickling anything (no trust needed)."""
    _gate(path, trust=True)              # what needs trust (pickled objects) is never unpickled here
    parsed = _parse(path)
    info = _modelkit_info(parsed)
    records = {**parsed.weights, **parsed.constants}
    prefix = info.get("prefix", "")
    names = info.get("state_dict")
    if names is None:                    # not written by modelkit: every weight, then every tensor constant
        names = list(records)
        if parsed.pickled:
            logger.warning("%s: %d entr%s that torch.export.load would unpickle (%s) not read", path,
                           len(parsed.pickled), "y" if len(parsed.pickled) == 1 else "ies", ", ".join(list(parsed.pickled)[:3]))
    missing = [n for n in names if prefix + n not in records]
    if missing:
        why = "is stored as a pickle, which modelkit does not read" if prefix + missing[0] in parsed.pickled else "is not"
        raise FormatError(path, f"tensor {missing[0]!r} listed in extra/{EXTRA_NAME} {why} among the program's weights")
    chosen = {name: records[prefix + name] for name in names}
    tensors = {name: _lazy(path, parsed, name, record) for name, record in chosen.items()}
    metadata = dict(info.get("metadata", {}))
    ties = tied_names(chosen)
    if ties and ALIASES_KEY not in metadata:
        metadata[ALIASES_KEY] = json.dumps(ties, sort_keys=True)
    arch = ArchSpec.from_json(info["arch"], source=path) if info.get("arch") is not None else None
    return Checkpoint(tensors=tensors, metadata=metadata, arch=arch)


def program(path: Path) -> dict[str, Any]:
    """What `modelkit inspect` shows of the archive's program: inputs and outputs (a dynamic dimension by its
    symbol), each symbol's range, counts of parameters, buffers, constants and nodes, and what wrote it."""
    _gate(path, trust=True)
    parsed = _parse(path)
    summary = parsed.program.summary()
    info = _modelkit_info(parsed)
    names, dims = info.get("inputs"), info.get("dims", {})
    if names and len(names) == len(summary["inputs"]):
        summary["inputs"] = [{**entry, "name": name} for entry, name in zip(summary["inputs"], names, strict=True)]
    if dims:                            # symbols by the names they were exported with ("s77" -> "batch")
        for entry in (*summary["inputs"], *summary["outputs"]):
            entry["shape"] = [dims.get(d, d) if isinstance(d, str) else d for d in entry["shape"] or []]
        summary["dynamic"] = {dims.get(k, k): v for k, v in summary["dynamic"].items()}
    summary["archive_version"] = parsed.version
    return summary


def _parse(path: Path) -> pt2_archive.PT2File:
    try:
        return pt2_archive.read(path)
    except ParseError as e:
        raise FormatError(path, e.reason) from e
    except OSError as e:
        raise FormatError(path, f"cannot read the file ({e})") from e


def _lazy(path: Path, parsed: pt2_archive.PT2File, name: str, record: TensorRecord) -> LazyTensor:
    """The tensor's bytes read when loaded (a view of the mapped file), and where they lie in it."""
    if record.dtype not in DTYPES:
        raise FormatError(path, f"tensor {name!r} is {record.dtype}, which modelkit does not read "
                                f"(it reads {', '.join(DTYPES)})")
    span = parsed.file.span(record)
    return LazyTensor(DTYPES[record.dtype], record.size, partial(parsed.file.array, record), f"{path}:{name}",
                      FileSpan(path, *span) if span is not None else None)


def _modelkit_info(parsed: pt2_archive.PT2File) -> dict[str, Any]:
    """extra/modelkit.json, checked; {} for archives modelkit did not write."""
    path = Path(parsed.source)
    try:
        data = parsed.read_extra(EXTRA_NAME, _EXTRA_LIMIT)
        if data is None:
            return {}
        info = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, ParseError) as e:
        raise FormatError(path, f"extra/{EXTRA_NAME} cannot be read as JSON ({e})") from e
    metadata = info.get("metadata", {}) if isinstance(info, dict) else None
    names = info.get("state_dict", []) if isinstance(info, dict) else None
    inputs = info.get("inputs", []) if isinstance(info, dict) else None
    dims = info.get("dims", {}) if isinstance(info, dict) else None
    ok = (isinstance(dims, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in dims.items()) and isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
          and isinstance(names, list) and all(isinstance(n, str) for n in names)
          and isinstance(inputs, list) and all(isinstance(n, str) for n in inputs)
          and isinstance(info.get("arch"), str | None) and isinstance(info.get("prefix", ""), str))
    if not ok:
        raise FormatError(path, f'extra/{EXTRA_NAME} must look like {{"metadata": {{str: str}}, "arch": JSON or null, '
                                '"state_dict": [names], "prefix": str, "inputs": [names], "dims": {str: str}}')
    return info


# ---- running ----------------------------------------------------------------------------------

def runnable(path: Path, options: ReadOptions = ReadOptions()) -> Callable[..., torch.Tensor]:
    """The archive's own program (torch.export.load(...).module()), for verification and evaluation.

    The scanner's gate runs first: dangerous content is refused, and content that runs the file's own code
    when loaded (pickled objects, operators from libraries of its own) needs trust.
    """
    import torch

    _gate(path, trust=options.trust)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)       # torch.export's notes on its own internals
            module = torch.export.load(str(path)).module()
    except Exception as e:  # torch.export.load raises RuntimeError, KeyError, SerializeError, ... on bad archives
        raise FormatError(path, f"torch.export.load failed ({type(e).__name__}: {_first_line(e)})") from e
    logger.info("%s: loaded with torch.export.load", path)
    return module


# ---- writing ----------------------------------------------------------------------------------

def write(ckpt: Checkpoint, path: Path, options: WriteOptions = WriteOptions()) -> None:
    """Export the module with torch.export (dynamic shapes) and save it with modelkit.json inside.

    The module is `options.module`, else rebuilt from the checkpoint's ArchSpec; example inputs are
    `options.example_inputs`, else the reference model's own.

    Raises:
        UnsupportedConversionError: no module and no ArchSpec ("pass --arch"), no example inputs for a user's
            module, `kv_cache` (an ONNX option), or torch.export refused the module.
    """
    import torch

    from modelkit.checkpoint import instantiate
    from modelkit.testing import causal_lm
    from modelkit.testing import export as export_shapes

    module = options.module
    if module is None:
        module = instantiate(ckpt, source="the checkpoint", target="pt2", dequantize=True)
    if options.kv_cache:
        raise UnsupportedConversionError(type(module).__name__, "pt2", "--kv-cache is an ONNX option")
    if causal_lm.is_causal_lm(module):
        target: torch.nn.Module = causal_lm.graph(module, kv_cache=False)
        inputs = causal_lm.export_inputs(module, kv_cache=False)
        dynamic = export_shapes.causal_lm_shapes(0, kv_cache=False)
        names, prefix = list(causal_lm.INPUT_NAMES), "model."
    else:
        target = module
        inputs = export_shapes.example_inputs(module, options.example_inputs, target="pt2")
        dynamic = export_shapes.dynamic_shapes(module, inputs, names=options.input_names, axes=options.dynamic_axes)
        names, prefix = list(options.input_names or ()), ""
    exported = _export(target, inputs, dynamic)
    info = {
        "dims": _dim_names(exported, dynamic, names),
        "format": _LAYOUT,
        "arch": ckpt.arch.to_json() if ckpt.arch is not None else None,
        "metadata": dict(ckpt.metadata),
        "state_dict": list(module.state_dict()),
        "prefix": prefix,
        "inputs": names,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with path.open("wb") as f:
            torch.export.save(exported, f, extra_files={EXTRA_NAME: json.dumps(info, sort_keys=True)})


def _dim_names(exported: Any, dynamic: tuple[Any, ...], inputs: list[str]) -> dict[str, str]:
    """The program's symbol for each dynamic dimension -> the name it was given ("s77" -> "batch"; an axis
    left free without a name, as `--dynamic x:2` leaves it: "x_2", as ONNX names it), from the user inputs'
    shapes as torch.export traced them."""
    def flat(spec: Any) -> list[Any]:
        return [x for s in spec for x in flat(s)] if isinstance(spec, tuple) else [spec]

    names: dict[str, str] = {}
    placeholders = {node.name: node for node in exported.graph.nodes if node.op == "placeholder"}
    user = [placeholders.get(name) for name in exported.graph_signature.user_inputs]
    for index, (node, spec) in enumerate(zip(user, flat(tuple(dynamic)), strict=False)):
        value = getattr(node, "meta", {}).get("val") if node is not None else None
        if not isinstance(spec, dict) or value is None:
            continue
        for axis, dim in spec.items():
            name = getattr(dim, "__name__", None) or f"{inputs[index] if index < len(inputs) else f'input{index}'}_{axis}"
            if name and axis < value.dim() and not str(value.shape[axis]).isdigit():
                names.setdefault(str(value.shape[axis]), name)
    return names


def _export(module: torch.nn.Module, inputs: tuple[Any, ...], dynamic: tuple[Any, ...]) -> Any:
    """torch.export.export in eval mode (the caller's modes restored after); its failure as
    UnsupportedConversionError naming the module."""
    import torch

    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return torch.export.export(module, tuple(inputs), dynamic_shapes=dynamic)
    except Exception as e:  # torch.export raises UserError, Unsupported, GuardOnDataDependent, ...
        raise UnsupportedConversionError(type(module).__name__, "pt2",
                                         f"torch.export.export failed ({type(e).__name__}: {_first_line(e)})") from e
    finally:
        for submodule, training in modes:
            submodule.training = training


def _first_line(error: Any) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:200] if lines else type(error).__name__
