"""Example inputs and dynamic axes for graph exports of users' own modules.

A graph export (ONNX, TorchScript) runs the module once on example inputs, and the output check
runs both the file and torch on them. The zoo brings its own; a user's module gets them from the
caller: tensors (API), or specs on the command line (`--input-shape`), made here into seeded
random tensors once the module is built.

Spec grammar (docs/cli.md): ``[NAME=]DIMS[:DTYPE][:LOW..HIGH]``, e.g. ``input=1x3x224x224:float32``,
``ids=1x16:int64``, ``ids=2x16:int64:0..32000``. DIMS are sizes joined by ``x``; DTYPE a torch dtype
name (default float32). Inputs are passed to ``forward`` positionally, in the order given; NAME
names the graph input (default: ``forward``'s parameter at that position).

Values (seeded, the same on every run):
- floating point: standard normal;
- bool: 0 or 1;
- integers: uniform in [LOW, HIGH) when the spec gives a range; else in [0, N) where N is the
  smallest ``num_embeddings`` of the module's nn.Embedding layers (token ids every table accepts),
  or [0, 100) for a module without one.

Dynamic axes: ``NAME:AXIS`` (``input:0``, ``ids:1``). When any is given, exactly those axes are
free in the exported graph; when none is, axis 0 (the batch) of every input is, as for the zoo.
"""
from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modelkit.errors import ConfigError, did_you_mean
from modelkit.storage.dtypes import DTYPES

if TYPE_CHECKING:
    from torch import nn

INPUT_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
INT_HIGH = 100          # integer inputs of a module without nn.Embedding: [0, 100)
SEED = 0

_SPEC = re.compile(r"^(?:(?P<name>[A-Za-z_][\w.]*)=)?(?P<dims>\d+(?:x\d+)*)"
                   r"(?::(?P<dtype>[a-z0-9_]+))?(?::(?P<low>-?\d+)\.\.(?P<high>-?\d+))?$")
_DYNAMIC = re.compile(r"^(?P<name>[A-Za-z_][\w.]*):(?P<axis>\d+)$")


@dataclass(frozen=True)
class InputSpec:
    """One example input described by shape and dtype (values are made by `make_inputs`)."""

    name: str | None
    shape: tuple[int, ...]
    dtype: str = "float32"
    low: int | None = None
    high: int | None = None

    @classmethod
    def parse(cls, text: str) -> InputSpec:
        """``[NAME=]DIMS[:DTYPE][:LOW..HIGH]`` -> InputSpec; ConfigError naming what is wrong."""
        match = _SPEC.match(text.strip())
        if match is None:
            raise ConfigError(f"--input-shape {text!r}: expected [NAME=]DIMS[:DTYPE][:LOW..HIGH], "
                              "e.g. input=1x3x224x224:float32 or ids=1x16:int64")
        dtype = match["dtype"] or "float32"
        if dtype not in INPUT_DTYPES:
            known = INPUT_DTYPES
            raise ConfigError(f"--input-shape {text!r}: unknown dtype {dtype!r}{did_you_mean(dtype, known)}; "
                              f"known: {', '.join(known)}")
        shape = tuple(int(d) for d in match["dims"].split("x"))
        if 0 in shape:
            raise ConfigError(f"--input-shape {text!r}: every size must be at least 1")
        low = high = None
        if match["low"] is not None:
            low, high = int(match["low"]), int(match["high"])
            if dtype == "bool" or DTYPES[dtype].is_floating_point or high <= low:
                raise ConfigError(f"--input-shape {text!r}: a LOW..HIGH range (HIGH excluded, HIGH > LOW) "
                                  "applies to integer inputs only")
        return cls(match["name"], shape, dtype, low, high)


@dataclass(frozen=True)
class ExampleInputs:
    """What a graph writer needs: the tensors in `forward`'s order, their graph names, and the
    axes left free per name (None: axis 0 of every input)."""

    tensors: tuple[Any, ...]
    names: tuple[str, ...]
    dynamic: dict[str, tuple[int, ...]] | None = None


Given = Any     # a tensor, a sequence of tensors, {name: tensor}, a spec string, or a sequence of specs


def parse_dynamic(items: Iterable[str] | Mapping[str, Sequence[int] | int] | None) -> dict[str, tuple[int, ...]] | None:
    """``["input:0", "ids:1"]`` (or ``{"ids": [0, 1]}``) -> {"input": (0,), "ids": (1,)}; None when empty."""
    if not items:
        return None
    axes: dict[str, list[int]] = {}
    if isinstance(items, Mapping):
        for name, value in items.items():
            axes[name] = [value] if isinstance(value, int) else list(value)
    else:
        for text in items:
            match = _DYNAMIC.match(str(text).strip())
            if match is None:
                raise ConfigError(f"--dynamic {text!r}: expected NAME:AXIS, e.g. input:0 or ids:1")
            axes.setdefault(match["name"], []).append(int(match["axis"]))
    return {name: tuple(sorted(set(values))) for name, values in axes.items()}


def example_inputs(module: nn.Module, given: Given, dynamic: Any = None, *, seed: int = SEED) -> ExampleInputs | None:
    """The caller's example inputs as tensors with names, checked against `dynamic`; None when
    nothing was given (the zoo's own inputs apply)."""
    import torch

    axes = parse_dynamic(dynamic)
    if given is None:
        if axes:
            raise ConfigError("--dynamic names axes of example inputs; give them too (--input-shape NAME=DIMS)")
        return None
    if isinstance(given, (str, InputSpec, torch.Tensor)):
        given = [given]
    if isinstance(given, Mapping):          # {name: tensor or "DIMS[:DTYPE]"}
        named = [(name, InputSpec.parse(x) if isinstance(x, str) else x) for name, x in given.items()]
    else:
        items = [InputSpec.parse(g) if isinstance(g, str) else g for g in given]
        named = [(x.name if isinstance(x, InputSpec) else None, x) for x in items]
    if not named:
        raise ConfigError("example inputs: none given")
    tensors = tuple(make_inputs(module, [x for _, x in named], seed=seed))
    names = _names(module, [n for n, _ in named])
    for name, dims in (axes or {}).items():
        if name not in names or not isinstance(tensors[names.index(name)], torch.Tensor):
            raise ConfigError(f"--dynamic {name}:{dims[0]}: no input named {name!r}{did_you_mean(name, names)}; "
                              f"inputs: {', '.join(names)}")
        rank = tensors[names.index(name)].dim()
        if dims[-1] >= rank:
            raise ConfigError(f"--dynamic {name}:{dims[-1]}: input {name!r} has {rank} axes (0..{rank - 1})")
    _run_once(module, tensors, names)
    return ExampleInputs(tensors, names, axes)


def _run_once(module: nn.Module, tensors: tuple[Any, ...], names: tuple[str, ...]) -> None:
    """Run the module once on the inputs, so a mismatch is one line here, not a traceback from an exporter."""
    import torch

    training = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            module(*tensors)
    except Exception as e:  # the user's own code: any error it raises
        shapes = ", ".join(f"{n}={'x'.join(map(str, t.shape))}:{str(t.dtype).removeprefix('torch.')}"
                           for n, t in zip(names, tensors, strict=True) if isinstance(t, torch.Tensor))
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ConfigError(f"{type(module).__name__} fails on the example inputs ({shapes}): "
                          f"{type(e).__name__}: {first[:200]}") from e
    finally:
        for m, mode in training:
            m.training = mode


def make_inputs(module: nn.Module | None, specs: Sequence[InputSpec | Any], *, seed: int = SEED) -> list[Any]:
    """Seeded random tensors for specs (tensors pass through); see the module docstring for the values."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    tables = [m.num_embeddings for m in module.modules() if isinstance(m, torch.nn.Embedding)] if module else []
    out = []
    for spec in specs:
        if not isinstance(spec, InputSpec):
            out.append(spec)
            continue
        dtype = DTYPES[spec.dtype].torch
        if dtype.is_floating_point:
            out.append(torch.randn(spec.shape, generator=generator).to(dtype))
        elif dtype == torch.bool:
            out.append(torch.randint(0, 2, spec.shape, generator=generator).bool())
        else:
            low, high = (spec.low, spec.high) if spec.high is not None else (0, min(tables, default=INT_HIGH))
            out.append(torch.randint(low, high, spec.shape, generator=generator, dtype=torch.int64).to(dtype))
    return out


def _names(module: nn.Module, given: list[str | None]) -> tuple[str, ...]:
    """The graph's input names: the caller's, else `forward`'s parameter at that position, else input_<i>."""
    try:
        params = [p.name for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = tuple(name or (params[i] if i < len(params) else f"input_{i}") for i, name in enumerate(given))
    if len(set(names)) != len(names):
        raise ConfigError(f"example inputs: two inputs share a name ({', '.join(names)})")
    return names
