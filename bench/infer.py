"""Inference speed of quantized models: float against each scheme, and against other runtimes (issue 16).

    .venv/bin/python bench/infer.py [--threads 2] [--only probe,tinylm,llama,anchors,memory] [--schemes q4_k,...] [--json out.json]
                                    [--rounds 5] [--cpu-time]
    PYTHONPATH=/work/llama/site .venv/bin/python bench/infer.py      # with llama.cpp (llama-cpp-python)

Every figure is a ratio to a baseline timed in the same process, just before it (float32 on the same
model, or the other runtime on the same weights), so a loaded machine shifts both sides alike.

1. probe: torch's own CPU kernels (_weight_int8pack_mm, _int_mm, _weight_int4pack_mm_for_cpu,
   _dyn_quant_matmul_4bit) and modelkit's packed-weight kernels against fp32 `linear`, one layer,
   batch 1 and 64, at the shapes of tinylm and of a ~100M-parameter Llama.
2. tinylm (the zoo's default config) and llama-100m (transformers' LlamaForCausalLM, hidden 768,
   12 layers, 12 heads / 4 KV heads, MLP 2048, vocabulary 32000, random weights): forward latency
   on 16-token windows at batch 1 and 64 for float and every scheme (quantized layers as load_module
   builds them), float and the schemes interleaved in each of --rounds rounds, each ratio taken against
   float's time in the same round (median and range over the rounds reported; the bars judge the median;
   a quantized model's forward is the fused C forward where it applies: tinylm, quantizers/fast_forward.py;
   llama-100m, quantizers/hf_forward.py; each scheme is also timed in the same round inside
   fast_forward.unfused(), the model's own forward around the same packed layers, as `*_vs_unfused`);
   --cpu-time (with --threads 1) times in this thread's CPU time, so a shared machine's other work does not
   count; beside each ratio, the same ratio in process CPU time (every thread of ours counted, spinning
   included), which load disturbs less than wall clock. For llama-100m also `generate` prompt processing (64 tokens) and decode tokens/s.
   Goals: int8 / int8-dynamic <= 0.6x float at batch 1, int4 / gptq layout / q4_0 / q4_k / q4_k_m <= 0.5x,
   q5_k / q6_k <= 0.6x, every scheme <= 1.0x at batch 64 (`--schemes q4_k,q6_k` picks some).
3. anchors, on the same weights: torchao int8 weight-only (torchao 0.18's int4 weight-only has no
   float32 CPU path: reported as unavailable); onnxruntime on modelkit's ONNX files (QDQ int8, int4);
   llama.cpp (llama-cpp-python, the same thread count) on the very GGUF files modelkit writes for a
   tinylm with the 100M body (hidden 768, 12 layers; its byte vocabulary, as llama.cpp reads tinylm),
   decode tokens/s against `modelkit generate` on those files (tinylm with serve's static key/value
   cache and its fused C step) and the same decoder's torch step, in interleaved rounds (`--rounds`), and
   against modelkit's layers from those files run in transformers' generate (its KV cache; the model's
   forward the fused one that load_module installs, which continues generate's cache: quantizers/hf_cache.py;
   and the same on transformers' forward, fast_forward.unfused(), the path before), each in every round.
   Goal: >= 0.5x llama.cpp for q8_0 and q4_0 (q4_k_m reported beside them).
   hfllama (part of anchors): the same against a transformers LlamaForCausalLM of llama-100m's shape
   (vocabulary 32000, 12 heads / 4 KV heads), saved with save_pretrained (the llama3 tokenizer fixture) and
   quantized from that folder to GGUF by `modelkit quantize`: llama.cpp on the file against `modelkit
   generate` on it (pipeline.generate.generate_tokens: the fused step, pipeline/hf_llama_decoder.py) and
   against transformers' generate on the same loaded layers with transformers' forward (the path before it,
   fast_forward.unfused()), interleaved rounds; also
   the CPU time (process time) per decoded token of llama.cpp and of the fused decoder's steps; and prompt
   processing tokens/s of all three (modelkit: the fused forward into the cache, DecodePlan.forward).
4. memory: resident memory (RSS growth in a fresh process) of load_module's model from modelkit's GGUF
   files of that tinylm (q4_k_m, q6_k, q4_0, q8_0) against the file's size. Goal: <= 1.15x.

Bars are reported, never asserted: the exit code is 0 either way.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modelkit import schemes
from modelkit.models import build

RESULTS: dict[str, Any] = {"rows": [], "bars": []}
LLAMA_100M = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 4, "max_position_embeddings": 512}
SCHEMES = ("int8", "int8-dynamic", "int4", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q4_k_m")
GOAL_BATCH1 = {"int8": 0.6, "int8-dynamic": 0.6, "int4": 0.5, "q4_0": 0.5, "q4_k": 0.5, "q8_0": 0.6, "q5_k": 0.6,
               "q6_k": 0.6, "q4_k_m": 0.5}


def bar(name: str, value: float, goal: float, higher: bool = False) -> None:
    ok = value >= goal if higher else value <= goal
    RESULTS["bars"].append({"bar": name, "value": round(value, 3), "goal": goal, "met": ok})
    print(f"  [{'met' if ok else 'MISSED'}] {name}: {value:.2f}x (goal {'>=' if higher else '<='} {goal}x)", flush=True)


CLOCK: Callable[[], float] = time.perf_counter     # --cpu-time: time.thread_time


def timed(fn: Callable[..., Any], *args: Any, repeats: int, min_seconds: float = 0.0) -> float:
    """Median seconds of `fn(*args)` after one warm-up call."""
    fn(*args)
    times: list[float] = []
    started = CLOCK()
    while len(times) < repeats or (CLOCK() - started < min_seconds and len(times) < 10 * repeats):
        t0 = CLOCK()
        fn(*args)
        times.append(CLOCK() - t0)
    return statistics.median(times)


def row(table: str, **values: Any) -> None:
    RESULTS["rows"].append({"table": table, **values})
    print("  " + "  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items()), flush=True)


# ------------------------------------------------------------------------------------------ 1. probe

SHAPES = {"tinylm qkv 192x192": (192, 192), "tinylm mlp 512x192": (512, 192), "llama q 768x768": (768, 768),
          "llama kv 256x768": (256, 768), "llama up 2048x768": (2048, 768), "llama down 768x2048": (768, 2048),
          "llama head 32000x768": (32000, 768)}


def _ratio(call: tuple[Callable[..., Any], tuple[Any, ...]], base: float, repeats: int) -> float | str:
    try:
        return round(timed(call[0], *call[1], repeats=repeats) / base, 2)
    except RuntimeError as e:          # a kernel this torch build refuses on CPU: say so in the table
        return f"error ({str(e)[:40]})"


def probe() -> None:
    from modelkit.quantizers import fast_linear, gguf_blocks, int4, int8
    from modelkit.quantizers.gguf_arrays import Q4_0Config, Q4_KConfig, Q5_KConfig, Q6_KConfig, Q8_0Config

    print("\n1. one layer: torch's CPU kernels and modelkit's against fp32 linear (ratio of latency)")
    for name, (n, k) in SHAPES.items():
        layer = nn.Linear(k, n, bias=False)
        ours = {"modelkit int8": int8.apply(nn.Sequential(layer), int8.Int8Config())[0],
                "modelkit int4": int4.apply(nn.Sequential(layer), int4.Int4Config())[0],
                "modelkit q8_0": gguf_blocks.apply(nn.Sequential(layer), Q8_0Config())[0],
                "modelkit q4_0": gguf_blocks.apply(nn.Sequential(layer), Q4_0Config())[0],
                # K types where the rows are whole super-blocks (llama shapes), else llama.cpp's fallback (tinylm)
                "modelkit q4_k": gguf_blocks.apply(nn.Sequential(layer), Q4_KConfig())[0],
                "modelkit q5_k": gguf_blocks.apply(nn.Sequential(layer), Q5_KConfig())[0],
                "modelkit q6_k": gguf_blocks.apply(nn.Sequential(layer), Q6_KConfig())[0]}
        wq = torch.randint(-127, 127, (n, k), dtype=torch.int8)
        scales = torch.rand(n)
        packed4 = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 15, (n, k), dtype=torch.int32), 1)
        zeros4 = torch.rand(k // 32, n, 2)
        dyn4 = torch._dyn_quant_pack_4bit_weight(torch.randint(0, 15, (n, k), dtype=torch.uint8),
                                                 torch.rand(n, k // 32), torch.zeros(n), 32, k, n)
        for batch in (1, 64):
            x = torch.randn(batch, k)
            xq = torch.randint(-127, 127, (max(batch, 17), k), dtype=torch.int8)     # _int_mm wants M > 16
            repeats = 5 if n * k * batch > 10**8 else 20
            with torch.no_grad():
                base = timed(F.linear, x, layer.weight, repeats=repeats)
                cells = {"_weight_int8pack_mm": (torch._weight_int8pack_mm, (x, wq, scales)),
                         "_int_mm": (torch._int_mm, (xq, wq.t())),
                         "_weight_int4pack_mm_for_cpu": (torch._weight_int4pack_mm_for_cpu, (x, packed4, 32, zeros4)),
                         "_dyn_quant_matmul_4bit": (torch._dyn_quant_matmul_4bit, (x, dyn4, 32, k, n))}
                cells.update({key: (m, (x,)) for key, m in ours.items()})
                ratios = {key: _ratio(fn, base, repeats) for key, fn in cells.items()}
            row("probe", shape=name, batch=batch, fp32_ms=base * 1e3, **ratios)
    print(f"  modelkit kernel: {fast_linear.ISA} (of {', '.join(fast_linear.ISAS)})")


# ------------------------------------------------------------------------------------- 2. models

def hf_llama(config: dict[str, Any], seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**config, tie_word_embeddings=False)).eval()


def quantized(model: nn.Module, scheme: str) -> nn.Module:
    from modelkit.pipeline.quantize import quantize_module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_module(model, schemes.load_scheme(scheme)()).eval()


def forward_ms(model: nn.Module, vocab: int, batch: int, repeats: int) -> float:
    return forward_times(model, vocab, batch, repeats)[0]


def forward_times(model: nn.Module, vocab: int, batch: int, repeats: int, *, fused: bool = True) -> tuple[float, float]:
    """(ms by CLOCK: median of the calls, process CPU ms: mean over the same calls, every thread counted);
    `fused=False`: inside fast_forward.unfused() (the forward around the packed layers: transformers' for
    llama-100m, tinylm's torch path)."""
    from modelkit.quantizers import fast_forward

    ids = torch.randint(0, vocab, (batch, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), contextlib.nullcontext() if fused else fast_forward.unfused():
        cpu, runs = time.process_time(), repeats + 1
        ms = 1e3 * timed(model, ids, repeats=repeats)
        return ms, 1e3 * (time.process_time() - cpu) / runs


def generate_rates(model: nn.Module, vocab: int, *, prompt: int = 64, new: int = 32) -> tuple[float, float]:
    """(prompt tokens/s, decode tokens/s) of transformers' greedy generate with KV cache."""
    import transformers

    class First:
        at = 0.0

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            First.at = First.at or time.perf_counter()
            return scores

    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(1))
    config = transformers.GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    best = (0.0, 0.0)
    with torch.no_grad():
        for _ in range(2):
            First.at = 0.0
            started = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                           logits_processor=transformers.LogitsProcessorList([First()]))
            ended = time.perf_counter()
            rates = (prompt / (First.at - started), (new - 1) / (ended - First.at))
            best = (max(best[0], rates[0]), max(best[1], rates[1]))
    return best


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def models(only: set[str], scheme_names: tuple[str, ...] = SCHEMES, rounds: int = 3) -> None:
    print(f"\n2. forward latency (16-token windows) and generate, each scheme against float32 on the same model, "
          f"{rounds} rounds interleaved: median [range] of the ratios")
    cases = []
    if "tinylm" in only:
        cases.append(("tinylm", build("tinylm", seed=0).eval(), 256, False))
    if "llama" in only:
        cases.append(("llama-100m", hf_llama(LLAMA_100M), 32000, True))
    for name, model, vocab, has_generate in cases:
        heavy = name != "tinylm"
        every = {"float32": model, **{scheme: quantized(model, scheme) for scheme in scheme_names}}
        gc.collect()
        ms: dict[str, dict[int, list[float]]] = {key: {1: [], 64: []} for key in [*every, *(f"{k} unfused" for k in scheme_names)]}
        cpu: dict[str, dict[int, list[float]]] = {key: {1: [], 64: []} for key in ms}
        for _ in range(rounds):
            for key, m in every.items():
                for b in (1, 64):
                    for fused in (True, False) if key != "float32" else (True,):
                        wall, used = forward_times(m, vocab, b, 1 if heavy and b > 1 else 10, fused=fused)
                        ms[key if fused else f"{key} unfused"][b].append(wall)
                        cpu[key if fused else f"{key} unfused"][b].append(used)
        rates = generate_rates(model, vocab) if has_generate else None
        row(name, scheme="float32", batch1_ms=statistics.median(ms["float32"][1]),
            batch64_ms=statistics.median(ms["float32"][64]),
            **({"prompt_tok_s": rates[0], "decode_tok_s": rates[1]} if rates else {}))
        for scheme in scheme_names:
            ratio = {b: [q / f for q, f in zip(ms[scheme][b], ms["float32"][b], strict=True)] for b in (1, 64)}
            cpu_ratio = {b: [q / f for q, f in zip(cpu[scheme][b], cpu["float32"][b], strict=True)] for b in (1, 64)}
            extra = {}
            if has_generate:
                q_rates = generate_rates(every[scheme], vocab)
                extra = {"prompt_vs_float": round(q_rates[0] / rates[0], 2), "decode_vs_float": round(q_rates[1] / rates[1], 2),
                         "decode_tok_s": q_rates[1]}
            unfused = f"{scheme} unfused"        # the same layers in the model's own forward, the same round
            fused_ratio = {b: [q / u for q, u in zip(ms[scheme][b], ms[unfused][b], strict=True)] for b in (1, 64)}
            fused_cpu = {b: [q / u for q, u in zip(cpu[scheme][b], cpu[unfused][b], strict=True)] for b in (1, 64)}
            row(name, scheme=scheme, batch1_ratio=spread(ratio[1]), batch64_ratio=spread(ratio[64]),
                batch1_process_cpu_ratio=spread(cpu_ratio[1]), batch64_process_cpu_ratio=spread(cpu_ratio[64]),
                batch1_vs_unfused=spread(fused_ratio[1]), batch64_vs_unfused=spread(fused_ratio[64]),
                batch1_process_cpu_vs_unfused=spread(fused_cpu[1]), batch64_process_cpu_vs_unfused=spread(fused_cpu[64]),
                **extra)
            bar(f"{name} {scheme} batch 1 / float", statistics.median(ratio[1]), GOAL_BATCH1.get(scheme, 1.0))  # others: faster than float
            bar(f"{name} {scheme} batch 64 / float", statistics.median(ratio[64]), 1.0)
        del every, model
        gc.collect()


# ------------------------------------------------------------------------------------ 3. anchors

def torchao_anchor() -> None:
    print("\n3a. torchao int8 weight-only (Int8WeightOnlyConfig) against modelkit int8, llama-100m")
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as e:
        print(f"  torchao not importable ({e}); pip install --no-deps torchao==0.18.0")
        return
    model = hf_llama(LLAMA_100M)
    ours = quantized(model, "int8")
    theirs = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(theirs, Int8WeightOnlyConfig())
    for batch in (1, 64):
        reps = 10 if batch == 1 else 3
        t_theirs = forward_ms(theirs, 32000, batch, reps)
        t_ours = forward_ms(ours, 32000, batch, reps)
        row("torchao", batch=batch, torchao_int8_ms=t_theirs, modelkit_int8_ms=t_ours, modelkit_vs_torchao=round(t_ours / t_theirs, 2))
        bar(f"modelkit int8 / torchao int8 weight-only, batch {batch}", t_ours / t_theirs, 1.0)
    d_theirs, d_ours = generate_rates(theirs, 32000)[1], generate_rates(ours, 32000)[1]
    row("torchao", decode_tok_s_torchao=d_theirs, decode_tok_s_modelkit=d_ours)
    bar("modelkit int8 decode / torchao int8 decode", d_ours / d_theirs, 1.0, higher=True)
    print("  torchao int4 weight-only: 0.18 has no float32 CPU path here (plain/preshuffled need mslk, "
          "tile_packed_to_4d needs CUDA and bfloat16): not measured")


def onnx_anchor() -> None:
    print("\n3b. onnxruntime on modelkit's ONNX files (QDQ int8; int4) against modelkit's own layers, tinylm")
    from modelkit.formats import load_format
    from modelkit.models.tinylm import example_inputs
    from modelkit.pipeline.quantize import save_quantized

    model = build("tinylm", seed=0).eval()
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in ("int8", "int4"):
            q = quantized(model, scheme)
            path = Path(tmp) / f"{scheme}.onnx"
            save_quantized(q, path, config=schemes.load_scheme(scheme)())
            run = load_format("onnx").runnable(path)
            for batch in (1, 64):
                x = example_inputs(batch)
                with torch.no_grad():
                    t_ort = timed(run, x, repeats=10)
                    t_ours = timed(q, x, repeats=10)
                row("onnxruntime", scheme=scheme, batch=batch, ort_ms=t_ort * 1e3, modelkit_ms=t_ours * 1e3,
                    modelkit_vs_ort=round(t_ours / t_ort, 2))


def own_generate_rates(model: nn.Module, *, prompt: int = 64, new: int = 32) -> tuple[float, float]:
    """(prompt tokens/s, decode tokens/s) of `modelkit generate` on a tinylm (pipeline.generate.generate_bytes:
    serve's key/value cache, its fused C step where the model's products are all packed)."""
    from modelkit.pipeline.generate import generate_bytes

    g = generate_bytes(model, bytes(range(1, prompt + 1)).decode("ascii"), max_new_tokens=new)
    return prompt / g.prompt_seconds, (new - 1) / g.decode_seconds


def torch_path_decode_rate(model: nn.Module, *, prompt: int = 64, new: int = 32) -> float:
    """Decode tokens/s of the same decoder with its torch step (TinyLMDecoder(fused=False)): the path before
    the fused step, greedy like `modelkit generate`."""
    from modelkit.pipeline.tinylm_decoder import Stream, TinyLMDecoder

    decoder = TinyLMDecoder(model, slots=1, fused=False)
    seq = Stream(list(range(1, prompt + 1)))
    with torch.no_grad():
        seq.ids.append(int(decoder.prefill(seq).argmax()))
        started = time.perf_counter()
        for _ in range(new - 1):
            seq.ids.append(int(decoder.step([seq])[0].argmax()))
    return (new - 1) / (time.perf_counter() - started)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def llama_cpp_anchor(threads: int, rounds: int) -> None:
    print(f"\n3c. llama.cpp on the GGUF files modelkit writes (tinylm with the 100M body), {threads} threads, "
          f"{rounds} interleaved rounds: median (range)")
    try:
        import llama_cpp
    except ImportError:
        print("  llama_cpp not importable: run with PYTHONPATH=/work/llama/site (llama-cpp-python 0.3.36)")
        return
    import modelkit
    from modelkit.checkpoint import Checkpoint
    from modelkit.quantizers import fast_forward, hf_forward

    body = {k: v for k, v in LLAMA_100M.items() if k != "vocab_size"}
    model = build("tinylm", body, seed=0).eval()
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in ("q8_0", "q4_0", "q4_k_m"):
            path = Path(tmp) / f"{scheme}.gguf"
            modelkit.save(Checkpoint.from_module(quantized(model, scheme)), path)
            # modelkit: the layers load_module builds from this file, in transformers' Llama (KV cache)
            loaded = modelkit.load_module(path)
            hf = hf_llama({**body, "vocab_size": 256})
            hf.load_state_dict({k: v for k, v in loaded.state_dict().items() if "." in k and k in hf.state_dict()},
                               strict=False)
            for name, module in loaded.named_modules():
                if type(module).__name__.startswith("Quantized"):
                    hf.set_submodule(name, module)
            hf_forward.install(hf)      # the fused forward, as load_module installs it on a Llama of packed layers
            generate_rates(hf, 256)                                      # warm-up
            llm = llama_cpp.Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=256, verbose=False)
            prompt = list(range(1, 65))
            runs: dict[str, list[float]] = {k: [] for k in ("llama_prompt", "llama", "own_prompt", "own", "torch_path",
                                                            "hf_prompt", "hf", "hf_unfused")}
            own_generate_rates(loaded)                                  # warm-up
            for _ in range(rounds):     # each round: llama.cpp, modelkit generate, the torch step, transformers' generate
                llm.reset()
                t0 = time.perf_counter()
                llm.eval(prompt)
                t1 = time.perf_counter()
                for i in range(31):
                    llm.eval([(i * 7) % 256])
                t2 = time.perf_counter()
                runs["llama_prompt"].append(64 / (t1 - t0))
                runs["llama"].append(31 / (t2 - t1))
                own_prompt, own_decode = own_generate_rates(loaded)
                runs["own_prompt"].append(own_prompt)
                runs["own"].append(own_decode)
                runs["torch_path"].append(torch_path_decode_rate(loaded))
                hf_prompt, hf_decode = generate_rates(hf, 256)
                runs["hf_prompt"].append(hf_prompt)
                runs["hf"].append(hf_decode)
                with fast_forward.unfused():           # the same on transformers' forward: the path before
                    runs["hf_unfused"].append(generate_rates(hf, 256)[1])
            del llm
            ratio = [o / ll for o, ll in zip(runs["own"], runs["llama"], strict=True)]
            before = [t / ll for t, ll in zip(runs["torch_path"], runs["llama"], strict=True)]
            row("llama.cpp", scheme=scheme, llama_cpp_decode_tok_s=_spread(runs["llama"]),
                modelkit_decode_tok_s=_spread(runs["own"]), torch_step_decode_tok_s=_spread(runs["torch_path"]),
                modelkit_vs_llama_cpp=_spread(ratio), torch_step_vs_llama_cpp=_spread(before),
                llama_cpp_prompt_tok_s=_spread(runs["llama_prompt"]), modelkit_prompt_tok_s=_spread(runs["own_prompt"]),
                hf_generate_prompt_tok_s=_spread(runs["hf_prompt"]), hf_generate_decode_tok_s=_spread(runs["hf"]),
                hf_generate_unfused_decode_tok_s=_spread(runs["hf_unfused"]))
            bar(f"{scheme} decode tokens/s, modelkit generate / llama.cpp (median of rounds)", statistics.median(ratio),
                0.5, higher=True)
            bar(f"{scheme} decode tokens/s, modelkit layers in transformers' generate / llama.cpp (median of rounds)",
                statistics.median([h / ll for h, ll in zip(runs["hf"], runs["llama"], strict=True)]), 0.5, higher=True)


def hf_llama_cpp_anchor(threads: int, rounds: int) -> None:
    """3d: see the module docstring (hfllama)."""
    print(f"\n3d. llama.cpp on GGUF files of a transformers Llama (llama-100m, vocabulary 32000), {threads} threads, "
          f"{rounds} interleaved rounds: median (range)")
    try:
        import llama_cpp
    except ImportError:
        print("  llama_cpp not importable: run with PYTHONPATH=/work/llama/site (llama-cpp-python 0.3.36)")
        return
    import shutil

    from modelkit.pipeline.generate import generate_tokens
    from modelkit.pipeline.hf_llama_decoder import llama_decoder
    from modelkit.pipeline.load import load_language_model
    from modelkit.pipeline.quantize import quantize as quantize_file
    from modelkit.pipeline.tinylm_decoder import Stream
    from modelkit.quantizers import fast_forward

    text = " ".join(f"w{i}" for i in range(40))
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folder = Path(tmp) / "llama"
        hf_llama(LLAMA_100M).save_pretrained(folder)
        for f in (Path(__file__).resolve().parent.parent / "fixtures" / "llama_cpp" / "hf" / "llama3").iterdir():
            shutil.copy(f, folder / f.name)
        for scheme in ("q8_0", "q4_0", "q4_k_m"):
            path = Path(tmp) / f"{scheme}.gguf"
            quantize_file(folder, path, scheme=scheme)
            lm = load_language_model(path)
            ids = list(lm.tokenizer(text)["input_ids"])
            llm = llama_cpp.Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=256, verbose=False)
            runs: dict[str, list[float]] = {k: [] for k in ("llama", "own", "hf", "llama_cpu", "own_cpu", "llama_prompt",
                                                              "own_prompt", "hf_prompt")}
            generate_tokens(lm.model, lm.tokenizer, text, max_new_tokens=4)                     # warm-up
            for _ in range(rounds):      # each round: llama.cpp, modelkit generate, transformers' generate, CPU times
                llm.reset()
                t0 = time.perf_counter()
                llm.eval(ids)
                runs["llama_prompt"].append(len(ids) / (time.perf_counter() - t0))
                t1, c1 = time.perf_counter(), time.process_time()
                for i in range(31):
                    llm.eval([(i * 7919) % 32000])
                runs["llama"].append(31 / (time.perf_counter() - t1))
                runs["llama_cpu"].append((time.process_time() - c1) / 31)
                g = generate_tokens(lm.model, lm.tokenizer, text, max_new_tokens=32)
                runs["own"].append((g.new_tokens - 1) / g.decode_seconds)
                runs["own_prompt"].append(g.prompt_tokens / g.prompt_seconds)
                with fast_forward.unfused():        # transformers' generate on transformers' forward
                    g = generate_tokens(lm.model, lm.tokenizer, text, max_new_tokens=32, fused=False)
                runs["hf"].append((g.new_tokens - 1) / g.decode_seconds)
                runs["hf_prompt"].append(g.prompt_tokens / g.prompt_seconds)
                decoder, seq = llama_decoder(lm.model, 1, len(ids) + 32), Stream(list(ids))
                with torch.no_grad():
                    seq.ids.append(int(decoder.prefill(seq).argmax()))
                    c1 = time.process_time()
                    for _ in range(31):
                        seq.ids.append(int(decoder.step([seq])[0].argmax()))
                runs["own_cpu"].append((time.process_time() - c1) / 31)
            del llm
            ratio = [o / ll for o, ll in zip(runs["own"], runs["llama"], strict=True)]
            before = [h / ll for h, ll in zip(runs["hf"], runs["llama"], strict=True)]
            cpu = [ll / o for o, ll in zip(runs["own_cpu"], runs["llama_cpu"], strict=True)]
            row("llama.cpp, transformers Llama", scheme=scheme, file_mib=round(path.stat().st_size / 2**20, 1),
                llama_cpp_decode_tok_s=_spread(runs["llama"]), modelkit_decode_tok_s=_spread(runs["own"]),
                transformers_generate_decode_tok_s=_spread(runs["hf"]), modelkit_vs_llama_cpp=_spread(ratio),
                transformers_generate_vs_llama_cpp=_spread(before),
                cpu_time_per_token_llama_cpp_over_modelkit=_spread(cpu), prompt_tokens=len(ids),
                llama_cpp_prompt_tok_s=_spread(runs["llama_prompt"]), modelkit_prompt_tok_s=_spread(runs["own_prompt"]),
                transformers_prompt_tok_s=_spread(runs["hf_prompt"]),
                modelkit_prompt_vs_llama_cpp=_spread([o / ll for o, ll in zip(runs["own_prompt"], runs["llama_prompt"],
                                                                              strict=True)]))
            bar(f"{scheme} transformers-Llama GGUF decode tokens/s, modelkit generate / llama.cpp (median of rounds)",
                statistics.median(ratio), 0.5, higher=True)


# ------------------------------------------------------------------------------------ 4. memory

_RSS_PROBE = """
import gc, sys, torch, modelkit
def rss():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))
ids = torch.randint(0, 256, (1, 16))
with torch.no_grad():
    modelkit.load_module(sys.argv[2])(ids)          # warm up: the modules a GGUF load imports, one forward
gc.collect()
before = rss()
model = modelkit.load_module(sys.argv[1])
gc.collect()
loaded = rss()
with torch.no_grad():
    model(ids)
gc.collect()
print(loaded - before, rss() - before)
"""


def memory() -> None:
    """Resident memory of load_module's model, in a fresh process, against the GGUF file's size."""
    import subprocess

    import modelkit
    from modelkit.checkpoint import Checkpoint

    print("\n4. resident memory (RSS growth) of load_module's model from modelkit's GGUF files, tinylm with the 100M body")
    body = {k: v for k, v in LLAMA_100M.items() if k != "vocab_size"}
    model = build("tinylm", body, seed=0).eval()
    tiny = build("tinylm", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4},
                 seed=0).eval()
    with tempfile.TemporaryDirectory() as tmp:
        warm = Path(tmp) / "tiny.gguf"
        modelkit.save(Checkpoint.from_module(quantized(tiny, "q4_0")), warm)
        for scheme in ("q4_k_m", "q6_k", "q4_0", "q8_0"):
            path = Path(tmp) / f"{scheme}.gguf"
            modelkit.save(Checkpoint.from_module(quantized(model, scheme)), path)
            out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(path), str(warm)], capture_output=True,
                                 text=True, check=True).stdout.split()
            size = path.stat().st_size
            loaded, ran = int(out[-2]) / size, int(out[-1]) / size
            row("memory", scheme=scheme, file_mib=size / 2**20, rss_after_load_vs_file=round(loaded, 3),
                rss_after_forward_vs_file=round(ran, 3))
            bar(f"{scheme} resident memory after load / file size", loaded, 1.15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="probe,tinylm,llama,anchors,memory",
                        help="parts, comma-separated: probe, tinylm, llama, anchors (or torchao, onnx, llamacpp, "
                             "hfllama), memory")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="the schemes of part 2, comma-separated")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds: part 2 (float and every scheme) and the llama.cpp anchor")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time in this thread's CPU time (needs --threads 1: other threads' time would not count)")
    args = parser.parse_args()
    if args.cpu_time:
        if args.threads != 1:
            parser.error("--cpu-time times one thread: use it with --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    torch.set_num_threads(args.threads)
    only = set(args.only.split(","))
    print(f"torch {torch.__version__}, {args.threads} threads, {'CPU' if args.cpu_time else 'wall-clock'} time; "
          "ratios are within this run (the machine may be loaded)")
    if "probe" in only:
        probe()
    models(only, tuple(args.schemes.split(",")), args.rounds)
    if only & {"anchors", "torchao"}:
        torchao_anchor()
    if only & {"anchors", "onnx"}:
        onnx_anchor()
    if only & {"anchors", "llamacpp"}:
        llama_cpp_anchor(args.threads, args.rounds)
    if only & {"anchors", "hfllama"}:
        hf_llama_cpp_anchor(args.threads, args.rounds)
    if "memory" in only:
        memory()
    if args.json:
        args.json.write_text(json.dumps(RESULTS, indent=2))
    met = sum(b["met"] for b in RESULTS["bars"])
    print(f"\n{met}/{len(RESULTS['bars'])} goals met")


if __name__ == "__main__":
    sys.exit(main())
