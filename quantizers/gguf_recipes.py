"""llama.cpp's quantization recipes (file types): which block type each tensor of a model gets.

`llama-quantize model-f16.gguf out.gguf Q4_K_M` does not write every weight as Q4_K: it keeps the
tensors that hurt most when squeezed (the attention value projection, the MLP's down projection of
some layers, the output head) in more bits, falls back to a 32-weight type where rows are not whole
256-weight super-blocks, and writes the file type in `general.file_type`. This module holds those
rules as data and one function, `plan`, that gives the type of every tensor from its llama.cpp name
and shape, so modelkit's files carry the same types as llama.cpp's for the same input.

Learned from llama.cpp's src/llama-quant.cpp (`llama_tensor_get_type`, `tensor_type_fallback`,
`tensor_allows_quantization`, `llama_ftype_get_default_type`; the version llama-cpp-python 0.3.36
builds) and written for modelkit. fixtures/llama_cpp/make_golden_recipes.py records llama.cpp's own
choices for every family and recipe; tests/test_gguf_recipes.py checks `plan` against them.

What `plan` needs of a tensor: its llama.cpp name (`blk.3.attn_v.weight`), its number of dimensions
and its row length (GGML's ne[0], the last numpy dimension). Of the model: its llama.cpp architecture,
layer count, attention heads and key/value heads, expert count (ModelFacts). The rules in brief:

- Only 2-D (and 3-D expert) tensors whose name ends in "weight" are quantized; norms, the MoE router,
  position embeddings and a few small tensors are kept as they are (`allows_quantization`).
- output.weight (and token_embd.weight when the output is tied to it) get Q6_K, or Q8_0 when their
  rows are not whole blocks of the recipe's type.
- attn_v (attn_qkv, attn_kv_b): Q2_K -> Q3_K (Q4_K with 4+ query heads per key/value head);
  Q3_K_M -> Q5_K for the first two, Q4_K after; Q3_K_L -> Q5_K; Q4_K_M / Q5_K_M -> Q6_K on the
  layers `use_more_bits` picks; Q4_K_S -> Q5_K for the first four. Llama 70B: Q3_K/Q4_K -> Q5_K;
  8 experts: Q8_0.
- ffn_down: Q2_K -> Q3_K; Q3_K_M -> Q5_K for the first 1/16 of the layers, else Q4_K; Q3_K_L -> Q5_K;
  Q4_K_M / Q5_K_M -> Q6_K on `use_more_bits` layers; Q4_K_S -> Q5_K for the first 1/8.
- attn_output: Q2_K -> Q3_K, Q3_K_M -> Q4_K, Q3_K_L -> Q5_K (8 experts: Q5_K for the low recipes).
- Rows that are not whole blocks of the chosen type: Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1,
  Q6_K -> Q8_0 (counted, as llama.cpp counts them); rows not whole 32-weight blocks either: F16.

`use_more_bits(i, n)`: the first and last eighth of the layers and every third layer between them.
Counters run in llama.cpp's order: tensors sorted by layer number (non-layer tensors first), then by name.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelkit.errors import ConfigError
from modelkit.metadata import ALIASES_KEY

if TYPE_CHECKING:       # the rules alone import nothing heavy (the CLI's --help reads RECIPES)
    from modelkit.checkpoint import Checkpoint

K_BLOCK, BLOCK = 256, 32


@dataclass(frozen=True)
class Recipe:
    """One llama.cpp file type: its name, LLAMA_FTYPE value, base block type and what it is for."""

    name: str                   # "q4_k_m": the scheme name (llama-quantize's, lower case)
    ftype: int                  # LLAMA_FTYPE_MOSTLY_*: general.file_type
    base: str                   # the block type of every tensor no rule picks otherwise
    more_bits: str              # what it keeps in more bits (docs, --help)
    pick: str                   # when to pick it (docs)


# llama.cpp's file types (llama.h LLAMA_FTYPE_MOSTLY_*), smallest first. docs/quantizers/gguf-recipes.md and
# `modelkit quantize --help` are generated from this table.
RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("q2_k", 10, "q2_k", "attn_v Q3_K (Q4_K with GQA >= 4), ffn_down and attn_output Q3_K, output Q6_K",
           "the smallest K file; quality drops visibly, best with an importance matrix"),
    Recipe("q3_k_s", 11, "q3_k", "output Q6_K only", "small and lossy; prefer Q3_K_M"),
    Recipe("q3_k_m", 12, "q3_k", "attn_v Q5_K (first 2) / Q4_K, ffn_down Q5_K (first 1/16) / Q4_K, "
           "attn_output Q4_K, output Q6_K", "the usual 3-bit file when memory is tight"),
    Recipe("q3_k_l", 13, "q3_k", "attn_v, ffn_down, attn_output Q5_K, output Q6_K", "3-bit with the sensitive tensors at 5"),
    Recipe("q4_k_s", 14, "q4_k", "attn_v Q5_K (first 4 layers), ffn_down Q5_K (first 1/8), output Q6_K",
           "a little smaller than Q4_K_M"),
    Recipe("q4_k_m", 15, "q4_k", "attn_v and ffn_down Q6_K on the use_more_bits layers, output Q6_K",
           "the default choice: most published GGUF files are Q4_K_M"),
    Recipe("q5_k_s", 16, "q5_k", "output Q6_K only", "near-lossless at 5.5 bits"),
    Recipe("q5_k_m", 17, "q5_k", "attn_v and ffn_down Q6_K on the use_more_bits layers, output Q6_K",
           "when quality matters more than the last 10 % of size"),
    Recipe("q6_k", 18, "q6_k", "nothing: every weight Q6_K (output Q6_K too)", "practically the float model's quality"),
)}
# The legacy file types: llama.cpp's LLAMA_FTYPE values, for general.file_type (their tensors are written as
# before: every quantizable weight in the type, the output head included; llama-quantize puts the output in Q6_K).
LEGACY_FTYPES: dict[str, int] = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9}

# ggml's weights per block of each type this module can pick
_BLOCK_WEIGHTS = {"q2_k": K_BLOCK, "q3_k": K_BLOCK, "q4_k": K_BLOCK, "q5_k": K_BLOCK, "q6_k": K_BLOCK,
                  "q4_0": BLOCK, "q4_1": BLOCK, "q5_0": BLOCK, "q5_1": BLOCK, "q8_0": BLOCK}
# tensor_type_fallback: the 32-weight type for rows that are not whole super-blocks
FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
# Substrings of names llama.cpp never quantizes (tensor_allows_quantization), besides norms and 1-D tensors
_KEPT_PARTS = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
               "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
               "indexer.q_proj.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.",
               "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
               *(f"time_mix_{p}.weight" for p in ("first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2",
                                                  "g1", "g2", "decay_w1", "decay_w2", "lerp_fused")))
_KEPT_NAMES = ("position_embd.weight", "token_types.weight")
_LAYER = re.compile(r"blk\.(\d+)\.")


def recipe(name: str) -> Recipe | None:
    """The recipe called `name` (any case), or None. (llama-quantize also takes Q3_K, Q4_K and Q5_K for its _M
    recipes; modelkit's schemes of those names are the plain block types.)"""
    return RECIPES.get(name.lower())


def ftype(scheme: str) -> int | None:
    """llama.cpp's LLAMA_FTYPE of a scheme (a recipe or a legacy type), or None."""
    found = recipe(scheme)
    return found.ftype if found is not None else LEGACY_FTYPES.get(scheme.lower())


@dataclass(frozen=True)
class ModelFacts:
    """What llama.cpp's rules read of the model: hparams as the GGUF file states them."""

    architecture: str = ""      # general.architecture ("llama", "gemma2", ...)
    n_layer: int = 0            # {arch}.block_count
    n_head: int = 0             # {arch}.attention.head_count
    n_head_kv: int = 0          # {arch}.attention.head_count_kv
    n_expert: int = 0           # {arch}.expert_count

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        """llama.cpp's LLM_TYPE_70B, the one model size its rules name."""
        return self.architecture == "llama" and self.n_layer == 80 and self.n_head != self.n_head_kv

    @classmethod
    def from_hparams(cls, architecture: str, hparams: Mapping[str, object], names: Iterable[str] = ()) -> ModelFacts:
        """From `{arch}.*` key suffixes -> values (block_count, attention.head_count, ...); the layer count
        from the `blk.N.` names when the hparams lack it."""
        def number(key: str, default: int = 0) -> int:
            value = hparams.get(key)
            return int(value) if isinstance(value, (int, float, str)) and str(value).lstrip("-").isdigit() else default

        layers = number("block_count") or 1 + max((int(m.group(1)) for n in names if (m := _LAYER.match(n))), default=-1)
        heads = number("attention.head_count")
        return cls(architecture, layers, heads, number("attention.head_count_kv", heads), number("expert_count"))


@dataclass(frozen=True)
class Tensor:
    """One tensor as llama.cpp's rules see it."""

    name: str                   # llama.cpp's name
    ndim: int
    row: int                    # ne[0]: the length of the rows blocks run along


@dataclass
class Plan:
    """`types`: llama.cpp name -> block type ("q4_k", "q8_0", ...), "f16", or None (kept as it is);
    `fallbacks`: how many tensors took a fallback type (llama.cpp's n_fallback)."""

    recipe: Recipe
    types: dict[str, str | None] = field(default_factory=dict)
    fallbacks: int = 0


def allows_quantization(name: str, ndim: int) -> bool:
    """Whether llama.cpp quantizes a tensor of this name at all (its tensor_allows_quantization)."""
    return (ndim >= 2 and name.endswith("weight") and name not in _KEPT_NAMES
            and not any(part in name for part in _KEPT_PARTS))


def category(name: str) -> str:
    """llama.cpp's tensor category: "output", "token_embd", "attn_v" (attn_v, attn_qkv, attn_kv_b), "attn_k",
    "attn_q", "attn_output", "ffn_up", "ffn_gate", "ffn_down" or "other"."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, kind in (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"), ("attn_v.weight", "attn_v"),
                       ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
                       ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if part in name:
            return kind
    return "other"


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: the first and last eighth, and every third between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def llama_order(names: Iterable[str]) -> list[str]:
    """Names in the order llama.cpp's loader walks them: by layer (non-layer tensors first), then by name."""
    def key(name: str) -> tuple[int, str]:
        m = _LAYER.match(name)
        return (int(m.group(1)) if m else -1, name)

    return sorted(names, key=key)


class _State:
    """llama.cpp's quantize_state_impl: counts of the attn_v tensors and ffn_down layers, and running indices."""

    def __init__(self, tensors: list[Tensor], facts: ModelFacts, has_imatrix: bool) -> None:
        self.facts = facts
        self.has_imatrix = has_imatrix
        self.n_attention_wv = sum(category(t.name) == "attn_v" for t in tensors)
        self.n_ffn_down = facts.n_layer
        self.i_attention_wv = self.i_ffn_down = 0
        self.tied = not any(category(t.name) == "output" for t in tensors)
        self.fallbacks = 0

    def layer(self, name: str) -> tuple[int, int]:
        """(layer index, layer count) of an ffn_down tensor: its running index, or with experts the name's."""
        if self.facts.n_expert > 1:
            m = _LAYER.match(name)
            if m is None or not 0 <= int(m.group(1)) < self.facts.n_layer:
                raise ConfigError(f"cannot tell the layer of expert tensor {name!r} (llama.cpp refuses it too)")
            return int(m.group(1)), self.facts.n_layer
        return self.i_ffn_down, self.n_ffn_down


def _rules(state: _State, recipe: Recipe, tensor: Tensor, kind: str) -> str:
    """llama_tensor_get_type_impl for the K and legacy file types: the type before any fallback."""
    f, name, facts = recipe.name, tensor.name, state.facts
    new = recipe.base
    falcon = facts.architecture == "falcon"
    if kind == "output" or (state.tied and kind == "token_embd"):
        if falcon or tensor.row % _BLOCK_WEIGHTS[new]:
            return "q8_0"
        return new if new == "q8_0" else "q6_k"
    if kind == "attn_v":
        i, n = state.i_attention_wv, state.n_attention_wv
        if f == "q2_k":
            new = "q4_k" if facts.n_gqa >= 4 else "q3_k"
        elif f == "q3_k_m":
            new = "q5_k" if i < 2 else "q4_k"
        elif f == "q3_k_l":
            new = "q5_k"
        elif f in ("q4_k_m", "q5_k_m") and use_more_bits(i, n):
            new = "q6_k"
        elif f == "q4_k_s" and i < 4:
            new = "q5_k"
        if facts.is_70b and new in ("q3_k", "q4_k"):
            new = "q5_k"
        if facts.n_expert == 8:
            new = "q8_0"
        state.i_attention_wv += 1
    elif kind == "attn_k":
        if facts.n_expert == 8:
            new = "q8_0"
    elif kind == "ffn_down":
        i, n = state.layer(name)
        if f == "q2_k":
            new = "q3_k"
        elif f == "q3_k_m":
            new = "q5_k" if i < n // 16 else "q4_k" if not falcon or use_more_bits(i, n) else "q3_k"
        elif f == "q3_k_l":
            new = "q4_k" if falcon else "q5_k"
        elif f == "q4_k_m":
            if falcon:
                new = "q6_k" if i < n // 16 else "q5_k" if use_more_bits(i, n) else "q4_k"
            elif use_more_bits(i, n):
                new = "q6_k"
        elif f == "q5_k_m" and use_more_bits(i, n):
            new = "q6_k"
        elif f == "q4_k_s" and not falcon and i < n // 8:
            new = "q5_k"
        elif f in ("q4_0", "q5_0") and state.has_imatrix and i < n // 8:
            new = "q4_1" if f == "q4_0" else "q5_1"
        state.i_ffn_down += 1
    elif kind == "attn_output":
        if falcon:
            new = "q4_k" if f == "q3_k_l" else new
        elif facts.n_expert == 8:
            new = "q5_k" if f in ("q2_k", "q3_k_s", "q3_k_m", "q4_k_s", "q4_k_m") else new
        else:
            new = {"q2_k": "q3_k", "q3_k_m": "q4_k", "q3_k_l": "q5_k"}.get(f, new)
    return new


def _fallback(state: _State, tensor: Tensor, chosen: str) -> str | None:
    """tensor_type_fallback: a 32-weight type (or F16) for rows that are not whole blocks of `chosen`;
    None where llama.cpp gives up (a 32-weight type whose rows are not whole blocks)."""
    if tensor.row % _BLOCK_WEIGHTS[chosen] == 0:
        return chosen
    state.fallbacks += 1
    if chosen not in FALLBACK:
        return None             # llama.cpp: "no tensor type fallback is defined" (it refuses the file)
    fallback = FALLBACK[chosen]
    return fallback if tensor.row % _BLOCK_WEIGHTS[fallback] == 0 else "f16"


def plan(recipe: Recipe | str, tensors: Iterable[Tensor], facts: ModelFacts, *, has_imatrix: bool = False) -> Plan:
    """Each tensor's type under `recipe`, as llama.cpp's quantizer picks it for the same names and shapes.

    Args:
        recipe: A Recipe or its name ("Q4_K_M", "q4_k_m").
        tensors: Every tensor the GGUF file holds (norms too: they take part in no rule but llama.cpp
            counts its attn_v tensors and looks for output.weight among all of them).
        facts: The model's hparams.
        has_imatrix: An importance matrix is used (changes Q4_0 / Q5_0's first ffn_down layers).

    Returns:
        The Plan: a type (or None: kept as it is) per name, and the number of fallbacks.
    """
    chosen = recipe if isinstance(recipe, Recipe) else globals()["recipe"](recipe)
    if chosen is None:
        raise ConfigError(f"unknown llama.cpp file type {recipe!r}; known: {', '.join(r.upper() for r in RECIPES)}")
    by_name = {t.name: t for t in tensors}
    ordered = [by_name[n] for n in llama_order(by_name)]
    state = _State(ordered, facts, has_imatrix)
    result = Plan(chosen)
    for tensor in ordered:
        if not allows_quantization(tensor.name, tensor.ndim):
            result.types[tensor.name] = None
            continue
        kind = category(tensor.name)
        result.types[tensor.name] = _fallback(state, tensor, _rules(state, chosen, tensor, kind))
    result.fallbacks = state.fallbacks
    return result


def markdown_table() -> str:
    """The recipes as the Markdown table docs/quantizers/gguf-recipes.md holds (a test keeps the page equal to it)."""
    rows = ["| scheme | general.file_type | base type | kept in more bits | pick it |", "|---|---|---|---|---|"]
    rows += [f"| `{r.name}` ({r.name.upper()}) | {r.ftype} | {r.base.upper()} | {r.more_bits} | {r.pick} |"
             for r in RECIPES.values()]
    return "\n".join(rows)


def describe(recipe: Recipe) -> str:
    """One line for --help: 'Q4_K_M (Q4_K; attn_v and ffn_down Q6_K on ... layers, output Q6_K)'."""
    return f"{recipe.name.upper()} ({recipe.base.upper()}; {recipe.more_bits})"


@dataclass
class Layout:
    """A checkpoint's tensors as llama.cpp will see them in the GGUF file modelkit writes: `llama` maps each
    stored name to llama.cpp's (a family's table; other names unchanged), `aliases` the tied names the file
    does not store to the name it stores, `tensors` what `plan` reads, `facts` the model's hparams."""

    llama: dict[str, str]
    aliases: dict[str, str]
    tensors: list[Tensor]
    facts: ModelFacts


def layout(ckpt: Checkpoint) -> Layout:
    """How the GGUF writer will store `ckpt` (the same names, tied tensors and dropped buffers as
    converters/gguf.py), for the recipe rules and for importance vectors keyed by llama.cpp names."""
    from modelkit.models import _hf, gguf_conventions

    rules = gguf_conventions(ckpt.arch) if ckpt.arch is not None else None
    try:
        aliases = {str(k): str(v) for k, v in json.loads(ckpt.metadata.get(ALIASES_KEY, "{}")).items()}
    except (json.JSONDecodeError, AttributeError) as e:
        raise ConfigError(f"the checkpoint's {ALIASES_KEY} metadata is not a JSON object of names ({e})") from e
    aliases = {a: t for a, t in aliases.items() if a in ckpt.tensors and t in ckpt.tensors}
    stored = [n for n in ckpt.tensors if n not in aliases and not (rules is not None and rules.dropped(n))]
    names = rules.names if rules is not None else {}
    llama = {n: names.get(n, n) for n in stored}
    flipped = rules.transposed if rules is not None else frozenset()
    tensors = []
    for n in stored:
        shape = tuple(ckpt.tensors[n].shape)
        row = shape[0] if n in flipped and len(shape) == 2 else (shape[-1] if shape else 1)
        tensors.append(Tensor(llama[n], len(shape), row))
    if rules is not None:
        facts = ModelFacts.from_hparams(rules.family.architecture, _hf.gguf_hparams(rules.family, rules.config),
                                        llama.values())
    else:           # a GGUF file of another tool: its own {arch}.* keys
        arch = str(ckpt.metadata.get("general.architecture", ""))
        hparams: dict[str, Any] = {k[len(arch) + 1:]: v for k, v in ckpt.metadata.items() if arch and
                                   k.startswith(arch + ".")}
        facts = ModelFacts.from_hparams(arch, hparams, llama.values())
    return Layout(llama, aliases, tensors, facts)


def checkpoint_types(ckpt: Checkpoint, recipe_name: str, *, has_imatrix: bool = False) -> tuple[dict[str, str | None], Plan]:
    """Each tensor of `ckpt` (its own names, tied ones included) -> its type under the recipe, and the Plan."""
    found = layout(ckpt)
    chosen = plan(recipe_name, found.tensors, found.facts, has_imatrix=has_imatrix)
    types = {n: chosen.types[llama] for n, llama in found.llama.items()}
    types.update({alias: types.get(target) for alias, target in found.aliases.items()})
    return types, chosen
