"""A Hugging Face causal LM's exported graph (ONNX, in onnxruntime) run the way `text_metrics` runs transformers'
module, and the tokenizer a graph file is measured with.

The graph's signature is modelkit.testing.causal_lm's: input_ids, attention_mask, position_ids (and, for a
KV-cache export, past_key_values.N.key/value, fed empty) -> logits. An exported file holds no tokenizer, so
`modelkit eval model.onnx` looks for the tokenizer files next to it (where `optimum` and onnxruntime-genai
exports keep them), or in the folder `--tokenizer` names (the Hugging Face folder it was exported from).
"""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from modelkit.errors import ConfigError, UnsupportedConversionError
from modelkit.models import ArchSpec

PathLike = str | os.PathLike[str]


class GraphCausalLM(nn.Module):
    """An onnxruntime session on a causal LM's graph, with its transformers config: `model(input_ids=ids).logits`
    as transformers' module answers it (every position attended, positions 0..T-1)."""

    def __init__(self, run: Any, config: Any, source: str) -> None:
        super().__init__()
        self.run, self.config = run, config
        names = list(getattr(run, "input_names", ()))
        if names[:3] != ["input_ids", "attention_mask", "position_ids"]:
            raise UnsupportedConversionError(source, "onnxruntime", "evaluating a language model's graph needs the "
                                             "inputs input_ids, attention_mask, position_ids (as modelkit exports "
                                             f"causal LMs); the graph takes {', '.join(names) or 'none'}")
        self.past = [_empty_past_shape(run, name) for name in names[3:]]

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        batch, length = input_ids.shape
        mask = torch.ones(batch, length, dtype=torch.long)
        positions = torch.arange(length, dtype=torch.long).expand(batch, length)
        past = [torch.zeros(batch, heads, 0, dim) for heads, dim in self.past]
        logits = self.run(input_ids.cpu(), mask, positions, *past)
        return SimpleNamespace(logits=logits[0] if isinstance(logits, tuple) else logits)


def _empty_past_shape(run: Any, name: str) -> tuple[int, int]:
    """(kv_heads, head_dim) of a past_key_values input, from the graph's declared shape."""
    shape = next(i.shape for i in run.session.get_inputs() if i.name == name)
    if len(shape) != 4 or not all(isinstance(d, int) for d in shape[1::2]):
        raise ConfigError(f"graph input {name!r} has shape {shape}; expected [batch, kv_heads, past, head_dim]")
    return shape[1], shape[3]


def graph_causal_lm(path: Path, arch: ArchSpec, run: Any) -> GraphCausalLM:
    """The graph at `path` (its ArchSpec names a Hugging Face family) as a causal LM `text_metrics` runs."""
    from modelkit.models import _hf, hf_families

    return GraphCausalLM(run, _hf.hf_config(hf_families()[arch.name], arch.config), path.name)


def folder_tokenizer(folder: PathLike, *, trust: bool = False) -> Any:
    """transformers' tokenizer of the files in `folder` (`--tokenizer FOLDER`).

    Raises:
        ConfigError: not a folder, or no tokenizer.json or tokenizer.model in it.
    """
    if not Path(folder).is_dir():
        raise ConfigError(f"--tokenizer {folder}: not a folder; name the folder holding the model's tokenizer files")
    return _tokenizer_in(Path(folder), f"--tokenizer {folder}", trust=trust)


def tokenizer_beside(path: PathLike, *, trust: bool = False) -> Any:
    """transformers' tokenizer of the files next to the model file at `path` (an ONNX export carries none).

    Raises:
        ConfigError: no tokenizer.json or tokenizer.model there (one line that says where it looked).
    """
    folder = Path(path).absolute().parent
    return _tokenizer_in(folder, f"{path}: next to it, {folder}", trust=trust)


def _tokenizer_in(folder: Path, where: str, *, trust: bool) -> Any:
    from modelkit.converters.hf import read_assets
    from modelkit.models import _hf

    assets = read_assets(folder, trust=trust)
    if "tokenizer.json" not in assets and "tokenizer.model" not in assets:
        raise ConfigError(f"{where} has no tokenizer.json or tokenizer.model; a language model is measured with "
                          "its tokenizer: pass --tokenizer FOLDER (the Hugging Face folder it came from) or copy "
                          "that folder's tokenizer files next to the model")
    return _hf.tokenizer(assets, source=str(folder))
