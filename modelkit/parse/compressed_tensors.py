"""config.json's `quantization_config` as compressed-tensors (llm-compressor's library) writes it, checked field
by field before anything uses it. Standard library only.

    {"quant_method": "compressed-tensors", "format": "pack-quantized" | ... | "mixed-precision",
     "quantization_status": "compressed",
     "config_groups": {NAME: {"targets": [...], "format": FORMAT or null,
                              "weights": ARGS, "input_activations": ARGS or null, "output_activations": ...}},
     "ignore": [...], "kv_cache_scheme": ARGS or null, "sparsity_config": {...}, "transform_config": {...}}
    ARGS: {"num_bits": 8, "type": "int" | "float", "strategy": "tensor" | "channel" | "group" | "block" |
           "token" | ..., "group_size": 128 or null, "block_structure": [128, 128] or null,
           "symmetric": true, "dynamic": false, "actorder": null | "group" | "weight" | ...}

A target or ignore entry is a module name, "re:" + a regular expression matched at the start of a
name (Python `re.match`), or a module class name ("Linear"). The file is untrusted: sizes, counts and
types are checked here, and a pattern is refused when it is long or nests a repeat inside a repeat
(the shape that makes a regular expression backtrack for ever), so matching stays cheap.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from modelkit.errors import ParseError

QUANT_METHOD = "compressed-tensors"
MAX_GROUPS = 256
MAX_TARGETS = 4096               # entries of the ignore list, and of all groups' targets together
MAX_PATTERN = 512                # characters of one target
_NESTED_REPEAT = re.compile(r"\)[*+?{]")        # a quantified group: "(a+)+" and its kin
_STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group", "attn_head")


@dataclass(frozen=True)
class QuantArgs:
    """How one kind of value (weights, input activations, ...) is quantized."""

    num_bits: int
    type: str                     # "int" or "float"
    strategy: str
    group_size: int | None
    block_structure: tuple[int, int] | None
    symmetric: bool
    dynamic: bool | str           # True, False or "local"
    actorder: str | None

    def describe(self) -> str:
        kind = f"int{self.num_bits}" if self.type == "int" else f"fp{self.num_bits}" + (
            " (e4m3)" if self.num_bits == 8 else "")
        how = {"group": f"group {self.group_size}", "block": f"block {self.block_structure}"}.get(
            self.strategy, f"per {self.strategy}")
        return (f"{kind} {how}, {'symmetric' if self.symmetric else 'asymmetric'}"
                + (", dynamic" if self.dynamic else "") + (f", actorder {self.actorder}" if self.actorder else ""))


@dataclass(frozen=True)
class Group:
    """One config group: the modules it targets and how their weights and activations are quantized."""

    name: str
    targets: tuple[str, ...]
    format: str
    weights: QuantArgs | None
    input_activations: QuantArgs | None
    output_activations: QuantArgs | None


@dataclass(frozen=True)
class Config:
    format: str
    status: str
    groups: tuple[Group, ...]
    ignore: tuple[str, ...]
    kv_cache: QuantArgs | None
    sparsity: str | None          # the sparsity format, when a sparsity config names one
    transforms: bool              # a non-empty transform_config (rotations applied to the weights)


def _bad(source: str, where: str, why: str) -> ParseError:
    return ParseError(f"quantization_config {where}: {why}", source=source)


def _int(value: Any, source: str, where: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _bad(source, where, f"{value!r} is not an integer in {low}..{high}")
    return value


def _str(value: Any, source: str, where: str, limit: int = 100) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise _bad(source, where, f"{str(value)[:60]!r} is not a string of at most {limit} characters")
    return value


def _names(value: Any, source: str, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TARGETS:
        raise _bad(source, where, f"must be a list of at most {MAX_TARGETS} names")
    names = tuple(_str(v, source, where, MAX_PATTERN) for v in value)
    for name in names:
        if name.startswith("re:"):
            if _NESTED_REPEAT.search(name):
                raise _bad(source, where, f"pattern {name!r} repeats a repeated group; modelkit matches simple "
                                          "patterns only")
            try:
                re.compile(name[3:])
            except (re.error, OverflowError, RecursionError) as e:
                raise _bad(source, where, f"pattern {name!r} is not a regular expression ({e})") from e
    return names


def _args(value: Any, source: str, where: str) -> QuantArgs | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad(source, where, "must be an object or null")
    kind = value.get("type", "int")
    if kind not in ("int", "float"):
        raise _bad(source, f"{where}.type", f"{kind!r} is not 'int' or 'float'")
    group = value.get("group_size")
    strategy = value.get("strategy")
    if strategy is None:            # compressed-tensors infers it: a group size > 0 is "group", -1 "channel"
        strategy = "tensor" if group is None else "channel" if group == -1 else "group"
    if strategy not in _STRATEGIES:
        raise _bad(source, f"{where}.strategy", f"{strategy!r} is not one of {', '.join(_STRATEGIES)}")
    if group == -1 and strategy == "channel":
        group = None
    group = None if group is None else _int(group, source, f"{where}.group_size", 1, 1 << 24)
    if strategy in ("group", "tensor_group") and group is None:
        raise _bad(source, f"{where}.group_size", f"strategy {strategy!r} needs a group size")
    block = value.get("block_structure")
    if isinstance(block, str) and re.fullmatch(r"\d{1,8}x\d{1,8}", block):      # older releases: "128x128"
        block = [int(v) for v in block.split("x")]
    if block is not None:
        if not isinstance(block, list) or len(block) != 2:
            raise _bad(source, f"{where}.block_structure", "must be two sizes")
        block = (_int(block[0], source, f"{where}.block_structure", 1, 1 << 24),
                 _int(block[1], source, f"{where}.block_structure", 1, 1 << 24))
    if strategy == "block" and block is None:
        raise _bad(source, f"{where}.block_structure", "strategy 'block' needs a block structure")
    symmetric, dynamic = value.get("symmetric", True), value.get("dynamic", False)
    if not isinstance(symmetric, bool):
        raise _bad(source, f"{where}.symmetric", f"{symmetric!r} is not true or false")
    if not isinstance(dynamic, bool) and dynamic != "local":
        raise _bad(source, f"{where}.dynamic", f"{dynamic!r} is not true, false or 'local'")
    actorder = value.get("actorder")
    actorder = None if actorder in (None, False) else "group" if actorder is True else \
        _str(actorder, source, f"{where}.actorder", 20)                   # older releases: true meant "group"
    return QuantArgs(_int(value.get("num_bits", 8), source, f"{where}.num_bits", 1, 32), kind, strategy, group,
                     block, symmetric, dynamic, actorder)


def parse(value: Any, *, source: str) -> Config:
    """The checked form of a `quantization_config` whose quant_method is compressed-tensors.

    Raises:
        ParseError: a field of the wrong type or out of range, naming it.
    """
    if not isinstance(value, dict):
        raise _bad(source, "", "must be an object")
    top_format = _str(value.get("format") or "dense", source, "format")
    status = _str(value.get("quantization_status") or "compressed", source, "quantization_status")
    raw_groups = value.get("config_groups") or {}
    if not isinstance(raw_groups, dict) or len(raw_groups) > MAX_GROUPS:
        raise _bad(source, "config_groups", f"must be an object of at most {MAX_GROUPS} groups")
    groups = []
    for name, raw in raw_groups.items():
        where = f"config_groups.{_str(name, source, 'config_groups', 200)}"
        if not isinstance(raw, dict):
            raise _bad(source, where, "must be an object")
        group_format = raw.get("format")
        groups.append(Group(name, _names(raw.get("targets"), source, f"{where}.targets"),
                            top_format if group_format is None else _str(group_format, source, f"{where}.format"),
                            _args(raw.get("weights"), source, f"{where}.weights"),
                            _args(raw.get("input_activations"), source, f"{where}.input_activations"),
                            _args(raw.get("output_activations"), source, f"{where}.output_activations")))
    if sum(len(g.targets) for g in groups) > MAX_TARGETS:
        raise _bad(source, "config_groups", f"more than {MAX_TARGETS} targets in all")
    sparsity = value.get("sparsity_config")
    sparse_format = None
    if isinstance(sparsity, dict) and sparsity:
        sparse_format = _str(sparsity.get("format") or "unnamed", source, "sparsity_config.format")
        if sparse_format == "dense":
            sparse_format = None
    elif sparsity not in (None, {}):
        raise _bad(source, "sparsity_config", "must be an object or null")
    transforms = value.get("transform_config")
    if transforms not in (None, {}) and not isinstance(transforms, dict):
        raise _bad(source, "transform_config", "must be an object or null")
    return Config(top_format, status, tuple(groups), _names(value.get("ignore"), source, "ignore"),
                  _args(value.get("kv_cache_scheme"), source, "kv_cache_scheme"), sparse_format,
                  bool(transforms and any(transforms.get(k) for k in ("config_groups", "transforms"))))


def matches(target: str, module: str) -> bool:
    """Whether a target or ignore entry names `module` by its name or a pattern (class names never do)."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def is_class_name(target: str) -> bool:
    """A target naming a module class ("Linear", "LlamaDecoderLayer"): no dot, not a pattern, capitalised."""
    return not target.startswith("re:") and "." not in target and target[:1].isupper()
