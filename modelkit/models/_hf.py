"""What every Hugging Face family shares: the tables they extend, llama.cpp's hyperparameter rules and
building transformers' module. The families (llama.py, qwen2.py, ...) are plain data (`HFFamily`);
everything that computes lives here, once.

Learned from llama.cpp's convert_hf_to_gguf.py (TextModel.set_gguf_parameters and the per-family
classes) and transformers' GGUF loader (integrations/ggml.py); written for modelkit. No torch at
import; `build` imports transformers when it runs.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from modelkit.errors import ConfigError, MissingDependencyError
from modelkit.models.plugin import HFFamily

# Hugging Face Llama-style decoder names -> llama.cpp's (gguf-py's tensor_mapping.py has the same pairs).
# Families copy this and add or replace entries.
DECODER_TENSORS: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{n}.input_layernorm.weight": "blk.{n}.attn_norm.weight",
    "model.layers.{n}.self_attn.q_proj.weight": "blk.{n}.attn_q.weight",
    "model.layers.{n}.self_attn.k_proj.weight": "blk.{n}.attn_k.weight",
    "model.layers.{n}.self_attn.v_proj.weight": "blk.{n}.attn_v.weight",
    "model.layers.{n}.self_attn.o_proj.weight": "blk.{n}.attn_output.weight",
    "model.layers.{n}.post_attention_layernorm.weight": "blk.{n}.ffn_norm.weight",
    "model.layers.{n}.mlp.gate_proj.weight": "blk.{n}.ffn_gate.weight",
    "model.layers.{n}.mlp.up_proj.weight": "blk.{n}.ffn_up.weight",
    "model.layers.{n}.mlp.down_proj.weight": "blk.{n}.ffn_down.weight",
}
FUSED_QKV = "model.layers.{n}.self_attn.qkv_proj.weight"          # Phi-3's q, k and v rows in one tensor
QK_BIASES = {f"model.layers.{{n}}.self_attn.{p}_proj.bias": f"blk.{{n}}.attn_{p}.bias" for p in "qkv"}
QK_NORMS = {f"model.layers.{{n}}.self_attn.{p}_norm.weight": f"blk.{{n}}.attn_{p}_norm.weight" for p in "qk"}

# llama.cpp key suffix ("{arch}." + suffix) -> config.json key, for the Llama-style configs.
DECODER_HPARAMS: dict[str, str] = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}
ROPE_FREQS = "rope_freqs.weight"       # llama.cpp's per-dimension divisors for Llama-3 rope scaling
ROPE_LONG, ROPE_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"     # Phi-3's longrope
DERIVED_TENSORS = (ROPE_FREQS, ROPE_LONG, ROPE_SHORT)


def text_config(family: HFFamily, config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config: the folder's config.json, or its `text_config` part (gemma3)."""
    if family.text_config and isinstance(config.get(family.text_config), dict):
        return dict(config[family.text_config])
    return dict(config)


def _get(config: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = config.get(key)
    return default if value is None else value


def head_dim(config: Mapping[str, Any]) -> int:
    """head_dim as transformers computes it: explicit, else hidden_size / num_attention_heads."""
    heads = _get(config, "num_attention_heads", _get(config, "n_head"))
    hidden = _get(config, "hidden_size", _get(config, "n_embd"))
    return int(_get(config, "head_dim", hidden // heads))


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The rope settings of the full-attention layers: transformers 5's `rope_parameters` (per layer type
    for Gemma 3), or the older `rope_theta` + `rope_scaling` pair."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    if not isinstance(params, dict):
        params = {"rope_theta": _get(config, "rope_theta", 10000.0), **(config.get("rope_scaling") or {})}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def gguf_hparams(family: HFFamily, config: Mapping[str, Any]) -> dict[str, Any]:
    """llama.cpp's hyperparameters for a config.json, as key suffixes -> Python values (int, float, str).

    Raises:
        ConfigError: the config lacks a value llama.cpp needs, uses a rope scaling llama.cpp's family
            cannot express, or has query rows other than hidden_size in a fused attn_qkv (phi3 with pruned heads).
    """
    config = text_config(family, config)
    values: dict[str, Any] = {}
    for suffix, key in family.hparams.items():
        if config.get(key) is not None:
            values[suffix] = config[key]
    if "feed_forward_length" not in values and "n_embd" in config:          # GPT-2: n_inner or 4 x n_embd
        values["feed_forward_length"] = _get(config, "n_inner", 4 * config["n_embd"])
    missing = [s for s in ("embedding_length", "block_count", "attention.head_count") if s not in values]
    if missing:
        raise ConfigError(f"{family.architecture}: config.json lacks {family.hparams.get(missing[0], missing[0])!r}")
    values.setdefault("attention.head_count_kv", values["attention.head_count"])
    if "vocab_size" in config:
        values["vocab_size"] = config["vocab_size"]
    if family.architecture == "gpt2":                 # learned positions: no rope keys
        return _ordered(values)
    dim = head_dim(config)
    if family.query_scale_27b is not None:
        expected = query_pre_attn_scalar(family, values["block_count"], values["embedding_length"],
                                         values["attention.head_count"], dim)
        if config.get("query_pre_attn_scalar", 256) != expected:
            raise ConfigError(f"{family.architecture}: query_pre_attn_scalar is {config.get('query_pre_attn_scalar', 256)}, "
                              f"but llama.cpp scales this model's queries as if it were {expected} (its head_dim, or "
                              "hidden_size / heads for the 27B models) and a GGUF cannot hold another value")
    if family.head_dims or dim * values["attention.head_count"] != values["embedding_length"]:
        values["attention.key_length"] = values["attention.value_length"] = dim
    queries = dim * values["attention.head_count"]
    if FUSED_QKV in family.tensors and queries != values["embedding_length"]:
        raise ConfigError(f"{family.architecture}: {values['attention.head_count']} heads of {dim} make {queries} query "
                          f"rows, not hidden_size {values['embedding_length']}, and llama.cpp's {family.architecture} "
                          "cuts attn_qkv at hidden_size: a model with pruned heads has no GGUF form (keep it a "
                          "Hugging Face folder: --to hf)")
    rope = rope_parameters(config)
    values["rope.dimension_count"] = int(dim * float(rope.get("partial_rotary_factor", 1.0)))
    values["rope.freq_base"] = float(rope.get("rope_theta", 10000.0))
    kind = rope["rope_type"]
    if kind in ("linear", "yarn"):
        values["rope.scaling.type"] = kind
        values["rope.scaling.factor"] = float(rope["factor"])
        if kind == "yarn" and rope.get("original_max_position_embeddings"):
            values["rope.scaling.original_context_length"] = int(rope["original_max_position_embeddings"])
    elif kind == "longrope":                          # Phi-3 128k: the factors travel as tensors (rope_tensors)
        original = int(_get(rope, "original_max_position_embeddings", config.get("original_max_position_embeddings")))
        scale = values.get("context_length", original) / original
        values["rope.scaling.attn_factor"] = float(_get(rope, "attention_factor", math.sqrt(
            1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0))
        values["rope.scaling.original_context_length"] = original
    elif kind not in ("default", "llama3"):           # llama3: the rope_freqs tensor carries it
        raise ConfigError(f"{family.architecture}: rope type {kind!r} has no GGUF form in modelkit "
                          "(known: default, linear, yarn, llama3, longrope)")
    return _ordered(values)


# The order keys are written in (tinylm's llama.cpp golden file pins its bytes); others follow as computed.
_KEY_ORDER = ("context_length", "embedding_length", "block_count", "feed_forward_length", "rope.dimension_count",
              "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
              "rope.freq_base", "vocab_size")


def _ordered(values: dict[str, Any]) -> dict[str, Any]:
    first = {k: values[k] for k in _KEY_ORDER if k in values}
    return {**first, **{k: v for k, v in values.items() if k not in first}}


def rope_tensors(family: HFFamily, config: Mapping[str, Any]) -> dict[str, list[float]]:
    """The tensors llama.cpp reads rope scaling from, derived from the config (reading drops them again):
    Llama-3's `rope_freqs.weight`, Phi-3 longrope's `rope_factors_long/short.weight`."""
    config = text_config(family, config)
    if family.architecture == "gpt2":
        return {}
    rope = rope_parameters(config)
    if rope["rope_type"] == "longrope":
        return {ROPE_LONG: [float(v) for v in rope["long_factor"]], ROPE_SHORT: [float(v) for v in rope["short_factor"]]}
    factors = llama3_rope_factors(config) if family.architecture == "llama" else None
    return {ROPE_FREQS: factors} if factors is not None else {}


def llama3_rope_factors(config: Mapping[str, Any]) -> list[float] | None:
    """Llama-3 rope scaling as llama.cpp stores it: one divisor per rotary frequency (`rope_freqs.weight`).

    Frequencies whose wavelength is short next to the original context keep their value (1), long ones
    are slowed by `factor`, and those between are blended smoothly (Meta's Llama 3.1 rule).
    """
    rope = rope_parameters(config)
    if rope["rope_type"] != "llama3":
        return None
    dim, base = head_dim(config), float(rope.get("rope_theta", 10000.0))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    context = float(rope.get("original_max_position_embeddings", 8192))
    factors = []
    for i in range(0, dim, 2):
        wavelength = 2 * math.pi * base ** (i / dim)
        if wavelength < context / high:
            factors.append(1.0)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return factors


def tensor_names(family: HFFamily, n_layers: int) -> dict[str, str]:
    """Every Hugging Face name of a model with `n_layers` blocks -> its llama.cpp name."""
    names: dict[str, str] = {}
    for hf, gguf_name in family.tensors.items():
        if "{n}" in hf:
            names.update({hf.format(n=n): gguf_name.format(n=n) for n in range(n_layers)})
        else:
            names[hf] = gguf_name
    return names


def block_count(family: HFFamily, config: Mapping[str, Any]) -> int:
    key = family.hparams["block_count"]
    return int(text_config(family, config)[key])


def query_pre_attn_scalar(family: HFFamily, blocks: int, hidden: int, heads: int, dim: int) -> int:
    """The query_pre_attn_scalar llama.cpp's Gemma graphs use: head_dim, or hidden / heads for the 27B models."""
    return hidden // heads if blocks == family.query_scale_27b else dim


def config_from_gguf(family: HFFamily, fields: Mapping[str, Any], *, tied: bool,
                     rope_tensors: Mapping[str, Sequence[float]] | None = None) -> dict[str, Any]:
    """A config.json rebuilt from a llama.cpp file's keys (for files that do not carry ours). `rope_tensors`:
    the file's rope_freqs / rope_factors_long / rope_factors_short, by name, where it has them: the rope
    scaling they carry goes back into the config (`rope_from_gguf`).

    Raises:
        ConfigError: the rope tensors follow no rule transformers has.
    """
    arch = family.architecture
    value = {s: fields[f"{arch}.{s}"] for s in (*family.hparams, "vocab_size", "attention.key_length",
                                                 "rope.freq_base", "rope.scaling.type", "rope.scaling.factor",
                                                 "rope.scaling.original_context_length", "rope.scaling.attn_factor")
             if f"{arch}.{s}" in fields}
    config: dict[str, Any] = {"architectures": [family.hf_class], "model_type": family.model_types[0],
                              "tie_word_embeddings": tied}
    for suffix, key in family.hparams.items():
        if suffix in value:
            v = value[suffix]
            config[key] = _float32(v) if isinstance(v, float) else v
    if "vocab_size" in value:
        config["vocab_size"] = value["vocab_size"]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):      # the special tokens llama.cpp keeps
        gguf_key = f"tokenizer.ggml.{'padding' if key == 'pad_token_id' else key.removesuffix('_token_id')}_token_id"
        if isinstance(fields.get(gguf_key), int):
            config[key] = fields[gguf_key]
    if "attention.key_length" in value:
        config["head_dim"] = value["attention.key_length"]
    if family.query_scale_27b is not None and {"embedding_length", "block_count", "attention.head_count"} <= set(value):
        hidden, heads = value["embedding_length"], value["attention.head_count"]
        config["query_pre_attn_scalar"] = query_pre_attn_scalar(family, value["block_count"], hidden, heads,
                                                                value.get("attention.key_length", hidden // heads))
    if arch != "gpt2":
        config["rope_parameters"] = rope_from_gguf(config, value, rope_tensors or {})
        original = value.get("rope.scaling.original_context_length")
        if config["rope_parameters"]["rope_type"] == "longrope" and isinstance(original, int):
            config["original_max_position_embeddings"] = original        # Phi-3 reads it from the config's top
    return config


def _float32(v: float) -> float:
    """A float32 key's value as written (1e-5 reads back as 9.99999974e-06; 7 digits give it back)."""
    return float(f"{v:.7g}")


def rope_from_gguf(config: Mapping[str, Any], value: Mapping[str, Any],
                   rope_tensors: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """transformers' rope_parameters of a llama.cpp file: its `rope.*` keys (key suffix -> value) and the
    tensors llama.cpp keeps rope scaling in (Llama-3's rope_freqs, Phi-3's rope_factors_long/short)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _float32(value.get("rope.freq_base", 10000.0))}
    kind = value.get("rope.scaling.type")
    original = value.get("rope.scaling.original_context_length")
    if kind in ("linear", "yarn"):
        rope.update(rope_type=kind, factor=_float32(value["rope.scaling.factor"]))
        if kind == "yarn" and isinstance(original, int):
            rope["original_max_position_embeddings"] = original
    if ROPE_LONG in rope_tensors and ROPE_SHORT in rope_tensors:
        if not all(math.isfinite(v) and v > 0 for name in (ROPE_LONG, ROPE_SHORT) for v in rope_tensors[name]):
            raise ConfigError(f"{ROPE_LONG} / {ROPE_SHORT} hold a factor that is not a positive number")
        if len(rope_tensors[ROPE_LONG]) != len(rope_tensors[ROPE_SHORT]):
            raise ConfigError(f"{ROPE_LONG} and {ROPE_SHORT} differ in length")
        rope.update(rope_type="longrope", long_factor=[_float32(v) for v in rope_tensors[ROPE_LONG]],
                    short_factor=[_float32(v) for v in rope_tensors[ROPE_SHORT]])
        if isinstance(value.get("rope.scaling.attn_factor"), float):
            rope["attention_factor"] = _float32(value["rope.scaling.attn_factor"])
    elif ROPE_FREQS in rope_tensors:
        rope.update(llama3_from_factors(config, rope["rope_theta"], [float(v) for v in rope_tensors[ROPE_FREQS]]))
    return rope


# Meta's Llama 3.1-3.3 settings: tried first, so a file of theirs reads back with its own config.json values
_LLAMA3_DEFAULT = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_from_factors(config: Mapping[str, Any], theta: float, factors: list[float]) -> dict[str, Any]:
    """Llama-3 rope scaling (factor, low/high_freq_factor, original context) that gives llama.cpp's
    per-frequency divisors `factors` (`rope_freqs.weight`) by transformers' rule (llama3_rope_factors).

    In x = 1 / wavelength the rule keeps a frequency (divisor 1) from x >= high / context, slows it by
    `factor` up to x <= low / context, and blends between, with smooth = (x - p) / (q - p) for p = low /
    context, q = high / context. The divisors fix the factor (the largest) and constrain p and q, not low,
    high and context apart; any choice in the constraints gives the same frequencies. Meta's values are
    kept where they fit, else the context stays 8192 and p, q are solved from the divisors.

    Raises:
        ConfigError: the divisors follow no such rule (a file from a tool that scales rope otherwise).
    """
    dim = head_dim(config)
    xs = [1 / (2 * math.pi * theta ** (i / dim)) for i in range(0, dim, 2)]
    if len(factors) != len(xs) or any(not math.isfinite(f) or f < 1 - 1e-6 for f in factors):
        raise ConfigError(f"rope_freqs.weight holds {len(factors)} divisors where a head of {dim} has "
                          f"{len(xs)} frequencies, or a divisor below 1: not Llama-3 rope scaling")
    factor = max(factors)
    if factor <= 1 + 1e-6:
        return {"rope_type": "default"}
    kept = [x for x, f in zip(xs, factors, strict=True) if f <= 1 + 1e-4]
    slowed = [x for x, f in zip(xs, factors, strict=True) if f >= factor * (1 - 1e-4)]
    # blended: smooth = (factor / f - 1) / (factor - 1), from 1 / f = (1 - smooth) / factor + smooth
    blend = [(x, (factor / f - 1) / (factor - 1)) for x, f in zip(xs, factors, strict=True)
             if 1 + 1e-4 < f < factor * (1 - 1e-4)]
    low_edge = max(slowed, default=min(xs) / 2)           # p at least this
    high_edge = min(kept, default=max(xs) * 2)            # q at most this
    if len(blend) >= 2:                                   # the line through the blended points
        (x0, s0), (x1, s1) = min(blend), max(blend)
        width = (x1 - x0) / (s1 - s0) if s1 != s0 else 0.0
        p, q = x0 - s0 * width, x0 - s0 * width + width
    elif blend:                                           # one point: any line through it within the edges
        (x0, s0), = blend
        q_most = min(high_edge, (x0 - (1 - s0) * low_edge) / s0) if s0 > 0 else high_edge
        q = (x0 + q_most) / 2
        p = (x0 - s0 * q) / (1 - s0) if s0 < 1 else x0
    else:                                                 # the switch lies between two frequencies
        p, q = low_edge + (high_edge - low_edge) / 3, low_edge + 2 * (high_edge - low_edge) / 3
    context = 8192
    candidates = [_LLAMA3_DEFAULT]
    if 0 < p < q:
        candidates.append({"factor": factor, "low_freq_factor": p * context, "high_freq_factor": q * context,
                           "original_max_position_embeddings": context})
    for candidate in candidates:
        settings = {k: _float32(v) if isinstance(v, float) else v for k, v in candidate.items()}
        got = llama3_rope_factors({**config, "rope_parameters": {"rope_type": "llama3", "rope_theta": theta, **settings}})
        if got is not None and all(abs(g - f) <= 1e-5 * f for g, f in zip(got, factors, strict=True)):
            return {"rope_type": "llama3", **settings}
    raise ConfigError("rope_freqs.weight does not follow Llama-3's rope scaling rule (the only one llama.cpp "
                      "stores this way that modelkit reads): convert from the model's Hugging Face folder instead")


def _transformers(what: str) -> Any:
    try:
        import transformers
    except ImportError as e:
        raise MissingDependencyError(f"{what} needs transformers: pip install 'modelkit[hf]'") from e
    return transformers


def hf_config(family: HFFamily, config: Mapping[str, Any]) -> Any:
    """transformers' config object (`AutoConfig`) for a config.json dict's language model.

    Raises:
        MissingDependencyError: transformers is not installed.
    """
    transformers = _transformers(f"building a {family.hf_class}")
    config = text_config(family, config)
    model_type = config.get("model_type", family.model_types[0])
    values = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    return transformers.AutoConfig.for_model(model_type, **values)


def build(family: HFFamily, config: Mapping[str, Any]) -> Any:
    """transformers' causal-LM module for a config.json dict (random weights; the caller loads them).

    Raises:
        MissingDependencyError: transformers is not installed.
    """
    return getattr(_transformers(f"building a {family.hf_class}"), family.hf_class)(hf_config(family, config)).eval()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")


def tokenizer(assets: Mapping[str, bytes], *, source: str = "the model") -> Any:
    """transformers' tokenizer (AutoTokenizer) of a model's tokenizer files (`Checkpoint.assets`): the
    files are written to a temporary folder and read from there, so a GGUF's rebuilt tokenizer works too.

    Raises:
        ConfigError: the model carries no tokenizer.json / tokenizer.model.
        MissingDependencyError: transformers is not installed.
    """
    import tempfile
    from pathlib import Path

    if "tokenizer.json" not in assets and "tokenizer.model" not in assets:
        raise ConfigError(f"{source} has no tokenizer (tokenizer.json or tokenizer.model); copy the model's "
                          "tokenizer files into its folder")
    transformers = _transformers("a Hugging Face tokenizer")
    with tempfile.TemporaryDirectory(prefix="modelkit-tokenizer-") as scratch:
        for name in TOKENIZER_FILES:
            if name in assets:
                (Path(scratch) / name).write_bytes(assets[name])
        return transformers.AutoTokenizer.from_pretrained(scratch)


@dataclass(frozen=True)
class Conventions:
    """How one model's tensors are stored for llama.cpp: its family's rules applied to its config.

    `names` maps every Hugging Face name to llama.cpp's; `heads` gives the heads whose rows are
    permuted (Q/K of llama), `transposed` the Conv1D weights, `offsets` the norms stored + offset.
    """

    family_name: str
    family: HFFamily
    config: dict[str, Any]                      # the language model's config.json values
    names: dict[str, str]
    heads: dict[str, int]
    transposed: frozenset[str]
    offsets: frozenset[str]
    tokenizer: str = "hf"                       # "hf": the folder's tokenizer files; "bytes": tinylm's byte vocabulary
    bos_id: int | None = None
    eos_id: int | None = None

    @property
    def from_gguf(self) -> dict[str, str]:
        return {g: h for h, g in self.names.items()}

    def dropped(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.family.dropped)


def conventions(family_name: str, family: HFFamily, config: Mapping[str, Any]) -> Conventions:
    """The Conventions of a model of `family` with this config.json."""
    config = text_config(family, config)
    n_layers = block_count(family, config)
    names = tensor_names(family, n_layers)
    heads: dict[str, int] = {}
    if family.rope_permute:
        n_head = int(config["num_attention_heads"])
        n_kv = int(_get(config, "num_key_value_heads", n_head))
        for hf, gguf_name in names.items():
            if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
                heads[hf] = n_head
            elif gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
                heads[hf] = n_kv
    transposed = frozenset(tensor_names(family, n_layers).keys() & {t.format(n=n) for t in family.transposed
                                                                     for n in range(n_layers)})
    offsets = frozenset(h for h, g in names.items() if family.norm_offset and g.endswith("norm.weight"))
    return Conventions(family_name, family, config, names, heads, transposed, offsets)


def describe(family_name: str, family: HFFamily, config: Mapping[str, Any], assets: Mapping[str, bytes]) -> dict[str, Any]:
    """What `modelkit inspect` says of a Hugging Face family's model: family, model_type, llama.cpp's
    architecture, context length, vocabulary size, tokenizer (kind, style, chat template)."""
    from modelkit.parse.hf import tokenizer_summary

    text = text_config(family, config)
    return {"family": family_name, "model_type": config.get("model_type"), "llama_cpp_architecture": family.architecture,
            "context_length": text.get(family.hparams["context_length"]), "vocab_size": text.get("vocab_size"),
            "tokenizer": tokenizer_summary(dict(assets))}


def zoo_config(rules: Conventions) -> dict[str, Any]:
    """config.json for a zoo model stored by a family's layout (tinylm, whose config fields are named as
    LlamaConfig's): the family's model_type and class, rope settings as transformers 5 writes them."""
    config = {k: v for k, v in rules.config.items() if k != "rope_theta"}
    config.update({"model_type": rules.family.model_types[0], "architectures": [rules.family.hf_class],
                   "rope_parameters": {"rope_type": "default", "rope_theta": float(rules.config.get("rope_theta", 10000.0))},
                   "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False})
    config.update({k: v for k, v in (("bos_token_id", rules.bos_id), ("eos_token_id", rules.eos_id)) if v is not None})
    return config


# The Q/K row order of llama.cpp's llama architecture: the GGUF converter (both ways) and the legacy ggml reader.

def to_llama_rope(w: Any, n_heads: int) -> Any:
    """Reorder each head's rows from Hugging Face's RoPE layout to llama.cpp's.

    Hugging Face rotates row i of a head with row i + head_dim/2 ("rotate half"); llama.cpp's llama
    architecture uses ggml's normal RoPE, which rotates rows 2i and 2i+1. Rows (head, half, i) become
    (head, i, half), as llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute) does.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def from_llama_rope(w: Any, n_heads: int) -> Any:
    """The inverse of to_llama_rope: rows (head, i, half) back to (head, half, i)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
