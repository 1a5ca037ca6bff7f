"""Tokenizers between a Hugging Face folder's files and GGUF metadata, as llama.cpp reads them.

Two kinds of tokenizer travel, both BPE (tokenizer.json's ``model.type``):

- **byte-level BPE** (GPT-2, Llama-3, Qwen2/3): ``tokenizer.ggml.model = "gpt2"``, merges, and
  ``tokenizer.ggml.pre`` naming the split regex, because llama.cpp does not run the regex in the
  file but one of its own list (src/llama-vocab.cpp, ``llm_tokenizer_bpe``).
- **SentencePiece-style BPE** with byte fallback and ``▁`` for spaces (Llama-2, Mistral, Gemma,
  Phi-3): ``tokenizer.ggml.model = "llama"``, ``pre = "default"``, a score per token (llama.cpp
  merges the adjacent pair whose union scores highest, so a token's score is minus the rank of the
  merge that makes it), ``add_space_prefix``; the merges are written too (llama.cpp ignores them
  for this model; transformers' GGUF reader and ``tokenizer_assets`` use them as they are).

llama.cpp's converter recognises ``pre`` by hashing the ids a released tokenizer gives for a
fixed text; that cannot recognise a tokenizer trained for one model. We read the definition
instead: the ``Split`` regex (or ``ByteLevel(use_regex=True)``) in tokenizer.json's
pre_tokenizer, looked up in ``PRE_TOKENIZERS``, so an unknown regex is a clear error, not a file
that llama.cpp tokenizes differently.

Token types are llama.cpp's (``gguf.TokenType``): added tokens marked special are CONTROL, other
added tokens USER_DEFINED, ``<0xAB>`` byte tokens BYTE, the unknown token UNKNOWN, padding
``[PAD{i}]`` UNUSED.

What llama.cpp's keys cannot say (Metaspace vs a Prepend normalizer, added tokens' strip flags)
travels in ``PARTS_KEY``; ``tokenizer_assets`` uses it when present and otherwise writes a
tokenizer that splits text as llama.cpp does. What llama.cpp itself cannot do (a normalizer,
Metaspace(first)'s space before the start of a prompt only) ``llamacpp_prompt`` writes into the
prompt instead. docs/formats/gguf.md has the table of keys.
"""
from __future__ import annotations

import json
import unicodedata
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gguf import GGUFValueType, TokenType
from gguf.constants import Keys

from modelkit.errors import FormatError, UnsupportedConversionError

K = Keys.Tokenizer
SPACE = "\u2581"   # SentencePiece's visible space
# modelkit's own key (llama.cpp ignores it): tokenizer.json's normalizer, pre_tokenizer and decoder, and
# the added tokens' strip flags, as JSON, so a folder written back from our GGUF splits text exactly as
# the original did. llama.cpp's keys
# cannot say it: add_space_prefix is one flag, while Llama-2 prepends in a normalizer (also after
# special tokens and before a leading space) and Mistral v0.3 with Metaspace(first) (neither).
PARTS_KEY = "modelkit.tokenizer.hf_parts"
# The files of a Hugging Face folder gguf_tokenizer_kv reads (those present); transformers >= 5 saves
# the chat template in chat_template.jinja, not in tokenizer_config.json.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class PreTokenizer:
    """One of llama.cpp's ``tokenizer.ggml.pre`` names and the Hugging Face split it stands for."""

    name: str
    split: str | None          # tokenizer.json Split regex; None: ByteLevel(use_regex=True), GPT-2's own
    ignore_merges: bool = False  # llama.cpp takes a word that is a token whole (BPE ignore_merges)
    nfc: bool = False          # the released tokenizer.json normalizes to NFC first


# The regexes as released tokenizer.json files spell them; llama.cpp's rewrite of each is in
# src/llama-vocab.cpp (llm_tokenizer_bpe), chosen by the name.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

PRE_TOKENIZERS: dict[str, PreTokenizer] = {p.name: p for p in (
    PreTokenizer("gpt-2", None),
    PreTokenizer("llama-bpe", _LLAMA3, ignore_merges=True),
    PreTokenizer("qwen2", _QWEN2, nfc=True),
    PreTokenizer("gpt-4o", _GPT4O),
    PreTokenizer("tekken", _TEKKEN, ignore_merges=True),
)}
# Other names llama.cpp accepts for the same regexes (GGUF files from its converter use them).
PRE_ALIASES = {"llama3": "llama-bpe", "llama-v3": "llama-bpe", "falcon3": "llama-bpe", "dbrx": "llama-bpe",
               "smaug-bpe": "llama-bpe", "deepseek-r1-qwen": "qwen2", "megrez": "qwen2", "phi-2": "gpt-2",
               "llama4": "gpt-4o"}


def _json(assets: Mapping[str, bytes], name: str) -> dict[str, Any]:
    raw = assets.get(name)
    if raw is None:
        return {}
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(name, f"not valid JSON ({e}); re-save the tokenizer with save_pretrained") from e
    return value if isinstance(value, dict) else {}


def _parts(node: Any, key: str) -> list[dict[str, Any]]:
    """A normalizer or pre_tokenizer as a flat list (a ``Sequence`` holds its parts under `key`)."""
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        return [p for child in node.get(key, []) for p in _parts(child, key)]
    return [node]


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


@dataclass(frozen=True)
class TokenizerKind:
    """What llama.cpp calls a tokenizer.json's tokenizer (also what `modelkit inspect` can show)."""

    model: str                  # tokenizer.ggml.model
    pre: str                    # tokenizer.ggml.pre
    add_space_prefix: bool | None


def identify(tokenizer_json: Mapping[str, Any]) -> TokenizerKind:
    """Which llama.cpp tokenizer a tokenizer.json is; raises naming what is not supported."""
    model = tokenizer_json.get("model") or {}
    mtype = model.get("type")
    if mtype != "BPE":
        raise UnsupportedConversionError(
            "tokenizer.json", "GGUF", f"tokenizer model {mtype!r} is not supported; known: BPE (byte-level, "
            "as GPT-2/Llama-3/Qwen2) and SentencePiece-style BPE with byte fallback (as Llama-2/Gemma/Phi-3)")
    pres = _parts(tokenizer_json.get("pre_tokenizer"), "pretokenizers")
    norms = _parts(tokenizer_json.get("normalizer"), "normalizers")
    metaspace = [p for p in pres if p.get("type") == "Metaspace"]
    replaces = [n for n in norms if n.get("type") == "Replace" and n.get("content") == SPACE]
    if model.get("byte_fallback") or metaspace or replaces:
        return TokenizerKind("llama", "default", _space_prefix(pres, norms))
    return TokenizerKind("gpt2", _byte_level_pre(pres, norms), None)


def _space_prefix(pres: list[dict[str, Any]], norms: list[dict[str, Any]]) -> bool:
    """add_space_prefix of a SentencePiece-style tokenizer; refuses parts llama.cpp has no equivalent of."""
    odd = [p.get("type") for p in pres if p.get("type") != "Metaspace"]
    odd += [n.get("type") for n in norms if not (n.get("type") == "Prepend" and n.get("prepend") == SPACE
                                                  or n.get("type") == "Replace" and n.get("content") == SPACE)]
    if odd:
        raise UnsupportedConversionError(
            "tokenizer.json", "GGUF", f"{odd} in a SentencePiece-style tokenizer have no llama.cpp equivalent; "
            "known: Metaspace, or a Prepend('▁') and Replace(' ', '▁') normalizer")
    if not pres:
        return any(n.get("type") == "Prepend" for n in norms)
    scheme = pres[0].get("prepend_scheme") or ("always" if pres[0].get("add_prefix_space", True) else "never")
    # llama.cpp's add_space_prefix puts a space before every piece of text that starts the prompt or follows a
    # special token, even one that starts with a space. 'first' cannot be said: false keeps every prompt that
    # starts with a special token or a space exact (bench/llamacpp_tokenizer.py measures both choices).
    if scheme == "first":
        warnings.warn("tokenizer.json: Metaspace(prepend_scheme='first') puts a space only before a prompt that "
                      "starts with text other than a space, which llama.cpp cannot do; written with "
                      "add_space_prefix false, so llama.cpp tokenizes every prompt that starts with a special token "
                      "or a space (as chat templates do) like the original, and any other prompt only when given "
                      "' ' + prompt (llamacpp_prompt)", stacklevel=4)
    elif scheme == "always":
        warnings.warn("tokenizer.json: Metaspace(prepend_scheme='always') puts no space before text that already "
                      "starts with one; llama.cpp's add_space_prefix does, so llama.cpp tokenizes text that starts "
                      "with a space (at the start or after a special token) differently", stacklevel=4)
    return scheme == "always"


def llamacpp_prompt(tokenizer_json: Mapping[str, Any], prompt: str) -> str:
    """The text llama.cpp must be given to tokenize as the Hugging Face tokenizer tokenizes `prompt`.

    For the GGUF ``gguf_tokenizer_kv`` writes, llama.cpp differs from tokenizer.json only where GGUF
    cannot say it (measured by bench/llamacpp_tokenizer.py): it applies no normalizer, so the text is
    put in NFC where the tokenizer normalizes to it (Qwen2); and Metaspace(prepend_scheme='first') puts
    a space before a prompt that starts with text other than a space or an added token, which llama.cpp
    cannot, so that space is written out. Every other prompt is returned as it is.
    """
    norms = _parts(tokenizer_json.get("normalizer"), "normalizers")
    if any(n.get("type") == "NFC" for n in norms):
        prompt = unicodedata.normalize("NFC", prompt)
    metaspace = [p for p in _parts(tokenizer_json.get("pre_tokenizer"), "pretokenizers") if p.get("type") == "Metaspace"]
    added = tuple(a["content"] for a in tokenizer_json.get("added_tokens") or [] if a.get("content"))
    if metaspace and metaspace[0].get("prepend_scheme") == "first" and prompt and not prompt.startswith((" ", SPACE, *added)):
        prompt = " " + prompt
    return prompt


def _byte_level_pre(pres: list[dict[str, Any]], norms: list[dict[str, Any]]) -> str:
    bad_norm = [n.get("type") for n in norms if n.get("type") != "NFC"]
    if bad_norm:
        raise UnsupportedConversionError(
            "tokenizer.json", "GGUF", f"normalizer {bad_norm} has no llama.cpp equivalent for a byte-level "
            "BPE tokenizer; llama.cpp applies none (NFC is tolerated)")
    byte_level = [p for p in pres if p.get("type") == "ByteLevel"]
    splits = [p for p in pres if p.get("type") == "Split"]
    others = [p.get("type") for p in pres if p.get("type") not in ("ByteLevel", "Split")]
    if not byte_level or others:
        seen = [p.get("type") for p in pres] or "none"
        raise UnsupportedConversionError(
            "tokenizer.json", "GGUF", f"pre_tokenizer {seen} is not one llama.cpp knows; a byte-level BPE "
            "needs ByteLevel, alone (GPT-2) or after one Split regex (Llama-3, Qwen2)")
    if byte_level[0].get("add_prefix_space"):
        raise UnsupportedConversionError(
            "tokenizer.json", "GGUF", "ByteLevel add_prefix_space=true has no llama.cpp equivalent")
    if not splits and byte_level[0].get("use_regex", True):
        return "gpt-2"
    if len(splits) != 1 or byte_level[0].get("use_regex", True):
        raise UnsupportedConversionError(
            "tokenizer.json", "GGUF", f"{len(splits)} Split regexes before ByteLevel(use_regex="
            f"{byte_level[0].get('use_regex', True)}); llama.cpp knows one Split followed by ByteLevel(use_regex=false)")
    split = splits[0]
    pattern = (split.get("pattern") or {}).get("Regex")
    found = [p.name for p in PRE_TOKENIZERS.values() if p.split == pattern]
    if not found or split.get("behavior") != "Isolated" or split.get("invert"):
        raise UnsupportedConversionError(
            "tokenizer.json", "GGUF", f"pre-tokenizer split {pattern or split.get('pattern')!r} "
            f"(behavior {split.get('behavior')}) is not one llama.cpp knows; known: "
            f"{', '.join(n for n, p in PRE_TOKENIZERS.items() if p.split)} (Isolated), and gpt-2's ByteLevel regex")
    return found[0]


def _token_id(token: Any, vocab: Mapping[str, int]) -> int | None:
    text = _content(token)
    return vocab.get(text) if text is not None else None


def _template_flags(post: Any, bos: int | None, eos: int | None) -> tuple[bool, bool] | None:
    """(add_bos, add_eos) from a TemplateProcessing post_processor, None if there is none."""
    for proc in _parts(post, "processors"):
        if proc.get("type") != "TemplateProcessing":
            continue
        single = proc.get("single") or []
        ids = {name: (spec.get("ids") or [None])[0] for name, spec in (proc.get("special_tokens") or {}).items()}
        first, last = ((ids.get((item.get("SpecialToken") or {}).get("id")) for item in (single[0], single[-1]))
                       if single else (None, None))
        return (first is not None and first == bos, last is not None and last == eos)
    return None


def _chat_templates(assets: Mapping[str, bytes], config: Mapping[str, Any]) -> dict[str, str]:
    """{"": default template, name: template ...} from tokenizer_config.json or chat_template.jinja."""
    template = config.get("chat_template")
    if template is None and "chat_template.jinja" in assets:
        template = assets["chat_template.jinja"].decode("utf-8")
    if template is None:
        template = _json(assets, "chat_template.json").get("chat_template")
    if isinstance(template, str):
        return {"": template}
    if isinstance(template, list):   # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
        return {("" if name == "default" else name): text for name, text in named.items()}
    return {}


def _vocabulary(tj: Mapping[str, Any], vocab_size: int, spm: bool) -> tuple[list[str], list[int], dict[str, int]]:
    """Tokens and their llama.cpp types by id, padded to vocab_size with [PAD{i}] (UNUSED)."""
    model = tj["model"]
    by_id: dict[int, str] = {i: t for t, i in model.get("vocab", {}).items()}
    types: dict[int, int] = {}
    for added in tj.get("added_tokens") or []:
        content, special = added["content"], added.get("special")
        if spm and not special and added.get("normalized", True):
            # matched after the normalizer, which writes ▁ for spaces; llama.cpp matches user-defined tokens
            # in the raw text, so it gets them with spaces (as llama.cpp's converter writes Gemma's "▁▁")
            content = content.replace(SPACE, " ")
        by_id[added["id"]] = content
        types[added["id"]] = TokenType.CONTROL if special else TokenType.USER_DEFINED
    n = max(by_id, default=-1) + 1
    if n > vocab_size:
        raise FormatError("tokenizer.json", f"has {n} tokens but the model's embedding has {vocab_size} rows; "
                          "the tokenizer does not belong to this model")
    unk = model.get("unk_token")
    tokens, toktypes = [], []
    for i in range(vocab_size):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            toktypes.append(TokenType.UNUSED)
            continue
        tokens.append(text)
        if spm and text == unk:
            kind = TokenType.UNKNOWN
        elif i in types:
            kind = types[i]
        elif spm and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            kind = TokenType.BYTE
        else:
            kind = TokenType.NORMAL
        toktypes.append(int(kind))
    return tokens, toktypes, {t: i for i, t in enumerate(tokens)}


def _merges(model: Mapping[str, Any]) -> list[str]:
    out = []
    for m in model.get("merges", []):
        out.append(m if isinstance(m, str) else " ".join(m))   # old files: "a b"; new: ["a", "b"]
    return out


def gguf_tokenizer_kv(assets: Mapping[str, bytes], vocab_size: int) -> dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]:
    """Every ``tokenizer.*`` key of a GGUF for the tokenizer in a Hugging Face folder.

    Args:
        assets: file name -> bytes: tokenizer.json (required), tokenizer_config.json,
            special_tokens_map.json, generation_config.json, chat_template.jinja when present.
        vocab_size: rows of the model's embedding; the vocabulary is padded to it.

    Returns:
        key -> (value, type, array item type), for ``gguf.GGUFWriter.add_key_value``.

    Raises:
        UnsupportedConversionError: a tokenizer llama.cpp would not tokenize the same way.
        FormatError: tokenizer.json missing or malformed, or more tokens than vocab_size.
    """
    if "tokenizer.json" not in assets:
        raise UnsupportedConversionError(
            "the folder", "GGUF", "it has no tokenizer.json (a slow-only tokenizer); save it with a fast tokenizer "
            "(AutoTokenizer.from_pretrained(...).save_pretrained(folder))")
    tj = _json(assets, "tokenizer.json")
    config = _json(assets, "tokenizer_config.json")
    special_map = _json(assets, "special_tokens_map.json")
    generation = _json(assets, "generation_config.json")
    kind = identify(tj)
    spm = kind.model == "llama"
    tokens, toktypes, vocab = _vocabulary(tj, vocab_size, spm)
    merges = _merges(tj["model"])

    U32, S, B, A = GGUFValueType.UINT32, GGUFValueType.STRING, GGUFValueType.BOOL, GGUFValueType.ARRAY
    kv: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = {
        K.MODEL: (kind.model, S, None),
        K.PRE: (kind.pre, S, None),
        K.LIST: (tokens, A, S),
        K.TOKEN_TYPE: (toktypes, A, GGUFValueType.INT32),
    }
    if merges:
        kv[K.MERGES] = (merges, A, S)
    if spm:
        kv[K.SCORES] = (_scores(tokens, merges), A, GGUFValueType.FLOAT32)
        kv[K.ADD_PREFIX] = (bool(kind.add_space_prefix), B, None)

    ids = _special_ids(tj, vocab, config, special_map, generation)
    kv.update({key: (ids[name], U32, None) for name, key in _ID_KEYS.items() if ids[name] is not None})
    flags = _template_flags(tj.get("post_processor"), ids["bos"], ids["eos"]) or (False, False)
    add_bos = config.get("add_bos_token", flags[0])
    add_eos = config.get("add_eos_token", flags[1])
    for flag, name in ((add_bos, "bos"), (add_eos, "eos")):
        if flag and ids[name] is None:
            raise FormatError("tokenizer_config.json", f"asks to add a {name} token but names none that is in the vocabulary")
    kv[K.ADD_BOS] = (bool(add_bos), B, None)
    kv[K.ADD_EOS] = (bool(add_eos), B, None)
    for name, text in _chat_templates(assets, config).items():
        kv[K.CHAT_TEMPLATE_N.format(name=name) if name else K.CHAT_TEMPLATE] = (text, S, None)
    parts: dict[str, Any] = {part: tj.get(part) for part in ("normalizer", "pre_tokenizer", "decoder")}
    parts["added_tokens"] = _token_flags(tj)
    kv[PARTS_KEY] = (json.dumps(parts, ensure_ascii=False, separators=(",", ":")), S, None)
    return kv


_ID_KEYS = {"bos": K.BOS_ID, "eos": K.EOS_ID, "unk": K.UNK_ID, "pad": K.PAD_ID}


def _special_ids(tj: Mapping[str, Any], vocab: Mapping[str, int], config: Mapping[str, Any],
                 special_map: Mapping[str, Any], generation: Mapping[str, Any]) -> dict[str, int | None]:
    """bos/eos/unk/pad ids: named in tokenizer_config.json or special_tokens_map.json, else generation_config's."""
    ids: dict[str, int | None] = {}
    for name in _ID_KEYS:
        token = config.get(f"{name}_token", special_map.get(f"{name}_token"))
        if name == "unk" and token is None:
            token = tj["model"].get("unk_token")
        found = _token_id(token, vocab)
        value = generation.get(f"{name}_token_id") if name != "unk" else None
        if found is None and isinstance(value, list) and value:     # Llama-3.1 lists several eos ids
            value = value[0]
        ids[name] = found if found is not None else value if isinstance(value, int) else None
    return ids


_FLAGS = ("single_word", "lstrip", "rstrip", "normalized")


def _token_flags(tj: Mapping[str, Any]) -> dict[str, dict[str, bool]]:
    """{id: flags} of the added tokens whose flags are not all false (Phi-3's rstrip markers), with a warning:

    llama.cpp strips around a token only where its loader says so by model name (src/llama-vocab.cpp).
    """
    flagged = {str(a["id"]): {f: bool(a.get(f)) for f in _FLAGS}
               for a in tj.get("added_tokens") or [] if any(a.get(f) for f in _FLAGS)}
    stripped = [a["content"] for a in tj.get("added_tokens") or [] if a.get("lstrip") or a.get("rstrip")]
    if stripped:
        warnings.warn(f"tokenizer.json: {len(stripped)} added tokens strip the whitespace next to them "
                      f"({', '.join(stripped[:3])}...); llama.cpp does so only for the models it names (Phi-3's "
                      "when general.name contains 'phi3' or 'phi-3'); elsewhere the whitespace around them "
                      "tokenizes differently", stacklevel=3)
    return flagged


def _scores(tokens: list[str], merges: list[str]) -> list[float]:
    """llama.cpp's SentencePiece merging picks the pair whose union scores highest: minus merge rank."""
    rank: dict[str, int] = {}
    for r, merge in enumerate(merges):
        left, _, right = merge.partition(" ")
        rank.setdefault(left + right, r)
    return [-float(rank[t] + 1) if t in rank else 0.0 for t in tokens]


# --- GGUF -> Hugging Face ----------------------------------------------------------------------

def _pre_for_file(name: Any) -> PreTokenizer:
    pre = PRE_TOKENIZERS.get(PRE_ALIASES.get(name, name))
    if pre is None:
        raise UnsupportedConversionError(
            "GGUF", "Hugging Face tokenizer", f"tokenizer.ggml.pre {name!r} has no tokenizer.json equivalent here; "
            f"known: {', '.join(sorted([*PRE_TOKENIZERS, *PRE_ALIASES]))}")
    return pre


def _split_merge(merge: str) -> list[str]:
    at = merge.find(" ", 1)   # as llama.cpp reads them: the first space after the first character
    return [merge[:at], merge[at + 1:]] if at > 0 else [merge, ""]


def _derived_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[list[str]]:
    """Merges a SentencePiece vocabulary implies: every split of a normal token into two tokens, best score first."""
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    found = []
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind != TokenType.NORMAL or len(token) < 2:
            continue
        for k in range(1, len(token)):
            left, right = token[:k], token[k:]
            if left in vocab and right in vocab:
                found.append((-scores[i], i, vocab[left], [left, right]))
    found.sort(key=lambda f: f[:3])
    return [f[3] for f in found]


def _template(bos: str | None, eos: str | None, ids: Mapping[str, int]) -> dict[str, Any] | None:
    """A TemplateProcessing post_processor that adds bos and/or eos around each sequence."""
    if bos is None and eos is None:
        return None

    def wrap(seq: str, type_id: int) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = [{"Sequence": {"id": seq, "type_id": type_id}}]
        if bos is not None:
            items.insert(0, {"SpecialToken": {"id": bos, "type_id": type_id}})
        if eos is not None:
            items.append({"SpecialToken": {"id": eos, "type_id": type_id}})
        return items
    named = [t for t in (bos, eos) if t is not None]
    return {"type": "TemplateProcessing", "single": wrap("A", 0), "pair": wrap("A", 0) + wrap("B", 1),
            "special_tokens": {t: {"id": t, "ids": [ids[t]], "tokens": [t]} for t in named}}


def _replace(pattern: str, content: str) -> dict[str, Any]:
    return {"type": "Replace", "pattern": {"String": pattern}, "content": content}


def _sentencepiece_parts(fields: Mapping[str, Any]) -> dict[str, Any]:
    """normalizer, pre_tokenizer and decoder of a SentencePiece-style vocabulary from llama.cpp's keys.

    llama.cpp says only whether a space is put in front (add_space_prefix), and it puts one at the
    start of every piece of text between special tokens: a normalizer's Prepend does the same, so
    that is what a file from elsewhere gets (transformers' GGUF reader picks Metaspace(first) for
    architectures other than phi3, which differs on text after a special token or a leading space).
    """
    prefix = bool(fields.get(K.ADD_PREFIX, True))
    decoder = {"type": "Sequence", "decoders": [
        _replace(SPACE, " "), {"type": "ByteFallback"}, {"type": "Fuse"},
        *([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if prefix else [])]}
    if prefix:
        normalizer = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, _replace(" ", SPACE)]}
        return {"normalizer": normalizer, "pre_tokenizer": None, "decoder": decoder}
    return {"normalizer": _replace(" ", SPACE), "pre_tokenizer": None, "decoder": decoder}


# When general.name contains "phi3" or "phi-3", llama.cpp strips the whitespace after every added token
# but these three, and after </s> (src/llama-vocab.cpp), as Phi-3's tokenizer.json does with rstrip.
_PHI3_KEEP_SPACE = {"<unk>", "<s>", "<|endoftext|>"}


def _llamacpp_token_flags(fields: Mapping[str, Any], tokens: list[str], types: list[int]) -> dict[str, dict[str, bool]]:
    """Added-token flags llama.cpp applies by model name, for a file without our parts key."""
    name = str(fields.get("general.name", "")).lower()
    if "phi3" not in name and "phi-3" not in name:
        return {}
    added = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
    return {str(i): {"rstrip": True} for i, (t, k) in enumerate(zip(tokens, types, strict=True))
            if t == "</s>" or (k in added and t not in _PHI3_KEEP_SPACE)}


def tokenizer_assets(fields: Mapping[str, Any]) -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json for a GGUF's tokenizer.

    Args:
        fields: the GGUF's key -> value (arrays as lists, strings decoded), as gguf.GGUFReader gives them.

    Returns:
        file name -> bytes that ``transformers.AutoTokenizer.from_pretrained(folder)`` loads.

    Raises:
        UnsupportedConversionError: a tokenizer model or pre-tokenizer without a tokenizer.json form here.
        FormatError: the file has no vocabulary.
    """
    kind = fields.get(K.MODEL)
    tokens = [str(t) for t in fields.get(K.LIST) or []]
    if not tokens:
        raise FormatError("GGUF", f"has no {K.LIST}; it carries no tokenizer to write")
    types = [int(t) for t in fields.get(K.TOKEN_TYPE) or [TokenType.NORMAL] * len(tokens)]
    if len(types) != len(tokens):
        raise FormatError("GGUF", f"has {len(tokens)} tokens but {len(types)} token types; the file is damaged")
    if kind == "llama":     # user-defined tokens written with spaces, as gguf_tokenizer_kv and llama.cpp do
        tokens = [t.replace(" ", SPACE) if k == TokenType.USER_DEFINED else t
                  for t, k in zip(tokens, types, strict=True)]
    ids = {t: i for i, t in reversed(list(enumerate(tokens)))}
    merges = [_split_merge(m) for m in fields.get(K.MERGES) or []]

    def token(key: str) -> str | None:
        i = fields.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None
    bos, eos, unk, pad = token(K.BOS_ID), token(K.EOS_ID), token(K.UNK_ID), token(K.PAD_ID)
    add_bos = bool(fields.get(K.ADD_BOS, kind == "llama"))
    add_eos = bool(fields.get(K.ADD_EOS, False))

    model: dict[str, Any] = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                             "ignore_merges": False, "vocab": ids, "merges": merges}
    if kind == "gpt2":
        pre = _pre_for_file(fields.get(K.PRE, "gpt-2"))
        level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": pre.split is None}
        split = {"type": "Split", "pattern": {"Regex": pre.split}, "behavior": "Isolated", "invert": False}
        parts = {"normalizer": {"type": "NFC"} if pre.nfc else None,
                 "pre_tokenizer": level if pre.split is None else {"type": "Sequence", "pretokenizers": [split, level]},
                 "decoder": {**level, "add_prefix_space": True, "use_regex": True}}
        model["ignore_merges"] = pre.ignore_merges
    elif kind == "llama":
        parts = _sentencepiece_parts(fields)
        model.update(byte_fallback=True, fuse_unk=True, unk_token=unk)
        if not merges:
            scores = [float(s) for s in fields.get(K.SCORES) or [0.0] * len(tokens)]
            model["merges"] = _derived_merges(tokens, types, scores)
    else:
        raise UnsupportedConversionError(
            "GGUF", "Hugging Face tokenizer", f"tokenizer.ggml.model {kind!r} is not supported; known: gpt2, llama")
    flags = _llamacpp_token_flags(fields, tokens, types)
    if PARTS_KEY in fields:     # written by gguf_tokenizer_kv: the original's own parts
        try:
            stored = json.loads(str(fields[PARTS_KEY]))
        except json.JSONDecodeError as e:
            stored = e
        if not isinstance(stored, dict):
            raise FormatError("GGUF", f"{PARTS_KEY} is not a JSON object ({stored}); drop the key to use "
                              "llama.cpp's defaults")
        parts = {part: stored.get(part) for part in ("normalizer", "pre_tokenizer", "decoder")}
        stored_flags = stored.get("added_tokens")
        flags = {k: v for k, v in stored_flags.items() if isinstance(v, dict)} if isinstance(stored_flags, dict) else {}

    special = (TokenType.CONTROL, TokenType.UNKNOWN)
    added = []
    for i, (t, k) in enumerate(zip(tokens, types, strict=True)):
        if k in (*special, TokenType.USER_DEFINED):
            # a user-defined token with ▁ is matched after the normalizer (see gguf_tokenizer_kv)
            own = flags.get(str(i), {"normalized": kind == "llama" and k == TokenType.USER_DEFINED and SPACE in t})
            added.append({"id": i, "content": t, **{f: bool(own.get(f)) for f in _FLAGS}, "special": k in special})
    body = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, **parts,
            "post_processor": _template(bos if add_bos else None, eos if add_eos else None, ids), "model": model}

    named = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad}
    named = {k: v for k, v in named.items() if v is not None}
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos,
                              "add_eos_token": add_eos, "clean_up_tokenization_spaces": False, **named}
    context = fields.get(f"{fields.get('general.architecture')}.context_length")
    if isinstance(context, int):
        config["model_max_length"] = context
    templates = {k.rpartition(".")[2]: v for k, v in fields.items() if k.startswith(K.CHAT_TEMPLATE + ".")}
    if K.CHAT_TEMPLATE in fields:
        config["chat_template"] = (str(fields[K.CHAT_TEMPLATE]) if not templates else
                                   [{"name": "default", "template": str(fields[K.CHAT_TEMPLATE])},
                                    *({"name": n, "template": str(t)} for n, t in templates.items())])

    def dump(value: Any) -> bytes:
        return json.dumps(value, ensure_ascii=False, indent=2).encode("utf-8")
    return {"tokenizer.json": dump(body), "tokenizer_config.json": dump(config), "special_tokens_map.json": dump(named)}
