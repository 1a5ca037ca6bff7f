"""Where llama.cpp's logits on a K-quant file part from ours: the file, or llama.cpp's arithmetic? (issue 15)

    PYTHONPATH=/path/to/llama_cpp/site .venv/bin/python bench/llamacpp_logits.py [model ...] [--recipes q4_k_m,...]

For each model of tests/test_gguf_recipes.py (seeded random weights, the shapes the recipe tests use) and each
recipe, modelkit quantizes the model's F16 GGUF and llama.cpp (llama-cpp-python, 1 thread, F32 KV cache) runs
the file on 16 tokens. Its logits are compared, as max |diff| / max |logit|, with two runs of the same
dequantized weights in torch (transformers for the Hugging Face families, modelkit's tinylm for tinylm):

- `float`: float32 activations (what fixtures/llama_cpp/recipes.json records as `logits_rel`);
- `as llama.cpp`: each matmul's input first rounded the way ggml's CPU dot product rounds it for that weight's
  type (q8_K: blocks of 256, a float scale, for the K-quants and IQ4_XS; q8_0: blocks of 32, an fp16 scale,
  for Q4_0/Q5_0/Q8_0/IQ4_NL; q8_1 for Q4_1/Q5_1; fp16 for F16; none for F32).

If the second figure is small, the file is right and the first figure is the price of llama.cpp's int8
activations, not a defect of the weights. The weights are the same bytes llama.cpp writes
(tests/test_gguf_recipes.py checks that), so nothing here depends on modelkit's quantizer.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
BLOCK = {"q8_K": 256, "q8_0": 32, "q8_1": 32}
ACTIVATION = {**{t: "q8_K" for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")},
              **{t: "q8_0" for t in ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL")},
              "Q4_1": "q8_1", "Q5_1": "q8_1", "F16": "f16", "BF16": "bf16", "F32": None}


def _recipe_tests():
    spec = importlib.util.spec_from_file_location("test_gguf_recipes", ROOT / "tests" / "test_gguf_recipes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["test_gguf_recipes"] = module
    spec.loader.exec_module(module)
    return module


def round_like_ggml(x: torch.Tensor, kind: str | None) -> torch.Tensor:
    """`x` (..., K) as ggml's CPU matmul sees it before the integer dot products: quantized and scaled back."""
    if kind is None:
        return x
    if kind == "f16":
        return x.half().float()
    if kind == "bf16":
        return x.bfloat16().float()
    block = BLOCK[kind]
    shape = x.shape
    blocks = x.float().reshape(-1, shape[-1] // block, block)
    if kind == "q8_K":
        # quantize_row_q8_K: the signed value of largest magnitude maps to -127; float scale
        index = blocks.abs().argmax(-1, keepdim=True)
        peak = blocks.gather(-1, index)
        iscale = torch.where(peak != 0, -127.0 / peak, torch.zeros_like(peak))
        q = torch.round(iscale * blocks).clamp(max=127)
        scale = torch.where(peak != 0, 1.0 / iscale, torch.zeros_like(peak))
    else:
        # quantize_row_q8_0 / q8_1 (AVX2): scale amax/127 stored in fp16, values rounded to nearest even
        amax = blocks.abs().amax(-1, keepdim=True)
        inverse = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
        q = torch.round(blocks * inverse)
        scale = (amax / 127.0).half().float()
    return (q * scale).reshape(shape).to(x.dtype)


def tensor_types(path: Path) -> tuple[str, dict[str, str]]:
    import gguf

    reader = gguf.GGUFReader(path)
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    return arch, {t.name.removesuffix(".weight"): t.tensor_type.name for t in reader.tensors}


def hook_matmuls(module: torch.nn.Module, arch: str, types: dict[str, str], layers: int) -> int:
    """Round every matmul's input in `module` as llama.cpp would for its weight's type; returns hooks added."""
    import gguf

    arch_enum = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_enum, layers)
    hooked = 0
    for name, layer in module.named_modules():
        if not hasattr(layer, "weight") or getattr(layer, "weight", None) is None or isinstance(layer, torch.nn.Embedding):
            continue
        weight = layer.weight
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        tensor = names.get_name(name)
        if tensor in (None, "token_embd"):              # a lookup, not a matmul
            continue
        kind = types.get(tensor) or (types.get("token_embd") if tensor == "output" else None)
        if kind is None:
            continue
        layer.register_forward_pre_hook(lambda _m, args, k=ACTIVATION[kind]: (round_like_ggml(args[0], k), *args[1:]))
        hooked += 1
    return hooked


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=64, n_threads=1, seed=0, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
    del llm
    return logits


def torch_logits(t, model: str, folder: Path, path: Path, ids: list[int], as_llama_cpp: bool) -> tuple[np.ndarray, int]:
    import modelkit
    from modelkit.quantizers.fast_linear import use_isa

    arch, types = tensor_types(path)
    layers = t.MODELS[model][1]["num_hidden_layers"]
    if t.MODELS[model][0] == "tinylm":
        module = modelkit.load_module(path).eval()
    else:                       # the GGUF's weights in transformers, as tests/test_hf_llama_cpp.py loads them
        module = t._hf_module().transformers_model(folder / "hf", path)
    hooked = hook_matmuls(module, arch, types, layers) if as_llama_cpp else 0
    with torch.no_grad(), use_isa(None):
        output = module(torch.tensor([ids]))
    return (output.logits if hasattr(output, "logits") else output)[0].float().numpy(), hooked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*")
    parser.add_argument("--recipes", default="q2_k,q4_k_m,q6_k,q4_0,q8_0")
    args = parser.parse_args()
    import modelkit

    t = _recipe_tests()
    print(f"{'model':14} {'recipe':8} {'float':>8} {'as llama.cpp':>13} {'matmuls':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models or list(t.MODELS):
            folder = Path(tmp) / model
            source = t.build_f16(model, folder)
            for recipe in args.recipes.split(","):
                path = folder / f"{recipe}.gguf"
                modelkit.quantize(source, path, scheme=recipe, force=True)
                import llama_cpp

                vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False).n_vocab()
                ids = [int(i) % vocab for i in np.random.default_rng(0).integers(3, 250, 16)]
                theirs = llama_cpp_logits(path, ids)
                figures = []
                for as_llama_cpp in (False, True):
                    ours, hooked = torch_logits(t, model, folder, path, ids, as_llama_cpp)
                    figures.append(float(np.abs(theirs - ours).max() / np.abs(ours).max()))
                print(f"{model:14} {recipe:8} {figures[0]:8.4f} {figures[1]:13.4f} {hooked:8d}", flush=True)


if __name__ == "__main__":
    main()
