"""Quantize model files and modules, measured: the API behind `modelkit quantize`.

The schemes themselves live in `modelkit.quantizers.<scheme>` and work on modules; this module
reads and writes files, trains QAT through the zoo's loop, rebuilds quantized models from
files, and measures what each scheme costs: bits per weight, file size, the model's own metric
before and after, CPU latency, and the time quantization took.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelkit import schemes
from modelkit.checkpoint import METRICS_KEY, ArchSpec, Checkpoint, LazyTensor, QuantizedTensor, instantiate
from modelkit.errors import ConfigError
from modelkit.formats import FORMATS, ReadOptions, WriteOptions, detect_format, format_for_output, load_format
from modelkit.metadata import FILE_TYPE_KEY, QUANT_KEY
from modelkit.pipeline.quantize_weights import (
    checkpoint_stats,
    is_block_scheme,
    is_tfjs_scheme,
    quantize_weights,
    tfjs_checkpoint,
)
from modelkit.pipeline.reports import QuantizeReport
from modelkit.pipeline.write import write_checkpoint, write_output

if TYPE_CHECKING:    # modules, training and measuring import torch where they run; a weight file to GGUF does not
    from torch import nn

PathLike = str | os.PathLike[str]
# Largest |torch quantized model - runtime| / max |torch output| accepted when a quantized model
# is written to a graph format: ONNX (the QDQ graph run with float32 products, converters/onnx.py)
# or TorchScript (the same torch ops: 0).
# Weight-only schemes compute the very same weights, so only summation order differs; int8-dynamic
# rounds activations to int8 in torch, which the QDQ graph (weights only) does not. Measured
# 2026-11-21 (torch 2.13.0, onnxruntime 1.31.1), max over cnn and tinylm, small test configs and
# the trained runs/ (docs/formats/onnx.md): weight-only 1.1e-06, int8-dynamic 0.024. Pinned at 9x / 4x.
RUNTIME_RTOL: dict[str | None, float] = {None: 1e-5, "int8-dynamic": 0.1}
# Tokens per gptq calibration window for a Hugging Face model (the zoo's tinylm calibrates on 128-byte windows).
CALIBRATION_TOKENS = 128


# ------------------------------------------------------------------------------- configs


def make_config(scheme: str | Any, *, group_size: int | None = None, skip: Sequence[str] = (), **options: Any) -> Any:
    """A scheme's config from its name and the CLI-level options (a config passes through).

    `group_size` applies to schemes that have one (int4, gptq) and is an error elsewhere;
    `skip` patterns are added to the config's own.
    """
    if not isinstance(scheme, str):
        config = scheme
    else:
        values: dict[str, Any] = {"scheme": scheme, **options}
        if group_size is not None:
            values["group_size"] = group_size
        config = schemes.config_from_dict(values)
    if skip:
        config = replace(config, skip=(*config.skip, *skip))
    return config


# ------------------------------------------------------------------------------- modules


def quantize_module(model: nn.Module, config: Any, *, calibration: Iterable[Any] | None = None) -> nn.Module:
    """Quantize a module with `config` (a new module; the input is left unchanged).

    Example:
        >>> from modelkit.models import build
        >>> from modelkit.quantizers.int8 import Int8Config
        >>> q = quantize_module(build("mlp", seed=0), Int8Config())
    """
    module = schemes.scheme_module(type(config).scheme)
    if calibration is not None:
        if type(config).scheme != "gptq":
            raise ConfigError(f"{type(config).scheme} takes no calibration data (only gptq does)")
        return module.apply(model, config, calibration=calibration)
    return module.apply(model, config)


def prepare_qat(model: nn.Module, config: Any) -> nn.Module:
    """Fake-quantize `model`'s layers for `config` (int8, int4 or int8-dynamic); see quantizers/qat.py."""
    from modelkit.quantizers.qat import prepare_qat as prepare

    return prepare(model, make_config(config))


def convert_qat(model: nn.Module) -> nn.Module:
    """Fold a trained QAT model into real quantized layers (what the PTQ scheme gives for its weights)."""
    from modelkit.quantizers.qat import convert_qat as convert

    return convert(model)


def train_qat(model: nn.Module, config: Any, *, epochs: int = 1, lr: float | None = None, steps: int | None = None,
              out: PathLike | None = None, progress: Callable[..., None] | None = None, seed: int = 0,
              data: PathLike | None = None) -> nn.Module:
    """Prepare, train with the zoo's loop (torchrun DDP works), convert: the quantized model.

    Args:
        model: A reference model (trained float weights).
        config: int8, int4 or int8-dynamic config (or scheme name).
        epochs: Passes over the training split.
        lr: Peak learning rate; default a tenth of the model's recipe (fine-tuning, not training).
        steps: Stop each epoch after this many steps.
        out: Folder for the training checkpoints (default: a temporary folder).
        data: Refused here: the zoo's models train on their own task (see `train_qat_lm` for text).
    """
    from modelkit.models import load_model_module
    from modelkit.pipeline.measure import arch_name
    from modelkit.pipeline.train import TrainConfig, train

    if data is not None:
        raise ConfigError(f"{type(model).__name__} trains on its own task's data; --data applies to QAT of Hugging "
                          "Face language models")
    name = arch_name(model)
    recipe = load_model_module(name).TRAINING
    prepared = prepare_qat(model, config)
    train_config = TrainConfig(epochs=epochs, lr=lr or recipe.lr / 10, warmup_steps=0, steps_per_epoch=steps, seed=seed)
    with contextlib.ExitStack() as stack:
        folder = Path(out) if out is not None else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        train(name, folder, config=train_config, model=prepared, force=True, progress=progress)
    return convert_qat(prepared.cpu())


def train_qat_lm(model: nn.Module, config: Any, tokenizer: Any, *, epochs: int = 1, lr: float | None = None,
                 steps: int | None = None, data: PathLike | None = None, progress: Callable[..., None] | None = None,
                 seed: int = 0, context: int | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """QAT of a Hugging Face causal LM: prepare, train on text with `pipeline.lm_train` (next-token loss on
    windows of `tokenizer`'s ids: `data`, or the standard library's train split), convert.

    `lr` defaults to lm_train.TRAIN_LR (fine-tuning a trained model). Returns the quantized model and the
    training summary (`train_causal_lm`'s).
    """
    from modelkit.pipeline.lm_train import LMTrainConfig, train_causal_lm

    prepared = prepare_qat(model, config)
    summary = train_causal_lm(prepared, tokenizer, LMTrainConfig(epochs=epochs, steps_per_epoch=steps, lr=lr, seed=seed,
                                                                 context=context), data=data, progress=progress)
    return convert_qat(prepared.cpu()), summary


# ------------------------------------------------------------------------------- measuring


# ------------------------------------------------------------------------------- files


@dataclass
class _Source:
    """A float model to quantize and what travels from its file to the output."""

    model: nn.Module
    info: dict[str, Any]                                   # the report's "source": path, format, bytes
    metadata: dict[str, str] = field(default_factory=dict)
    assets: dict[str, bytes] = field(default_factory=dict)  # a Hugging Face folder's tokenizer files


def _load_float(src: PathLike | nn.Module, *, source_format: str | None = None, trust: bool = False,
                key: str | None = None, arch: ArchSpec | str | None = None, allow_requantize: bool = False) -> _Source:
    from modelkit.pipeline.load import load, load_module

    if not isinstance(src, (str, os.PathLike)):
        return _Source(src.eval(), {"path": None, "module": type(src).__name__})
    path = Path(src)
    fmt = source_format or detect_format(path)
    ckpt = load(path, format=fmt, trust=trust, key=key)
    quantized = sorted({t.scheme.upper() for t in ckpt.tensors.values() if isinstance(t, QuantizedTensor)})
    if quantized and not (allow_requantize and arch is None):
        raise ConfigError(f"{path} is already quantized ({', '.join(quantized)}); quantize the float model, or pass "
                          "--allow-requantize to dequantize and quantize it again (quality is lost twice)")
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
    metadata = {k: v for k, v in ckpt.metadata.items() if k != METRICS_KEY}
    if quantized:                           # --allow-requantize: the dequantized weights, as llama-quantize takes them
        model = instantiate(load(path, format=fmt, trust=trust, key=key, dequantize=True), source=str(path))
    else:
        model = load_module(path, format=fmt, trust=trust, key=key, arch=arch)
    return _Source(model, {"path": str(path), "format": fmt, "bytes": size}, metadata, dict(ckpt.assets))


def _text_tokenizer(loaded: _Source, src: Any, purpose: str = "--eval measures") -> Any:
    """The tokenizer --eval measures (`purpose`: or QAT trains) a Hugging Face language model with (None for the
    zoo's models)."""
    if _family(loaded.model) is None:
        return None
    if "tokenizer.json" not in loaded.assets:
        raise ConfigError(f"{src}: {purpose} a language model on text with its own tokenizer, and this "
                          "model carries no tokenizer.json; copy the tokenizer files into its folder")
    from modelkit.models import _hf

    return _hf.tokenizer(loaded.assets, source=str(src))


def _family(model: nn.Module) -> Any:
    """The Hugging Face family (HFFamily) of a transformers model, or None for any other module."""
    from modelkit.models import family_for_config, hf_config_of, hf_family

    config = hf_config_of(model)
    return None if config is None else hf_family(family_for_config(config, source=type(model).__name__))


def _family_defaults(config: Any, model: nn.Module) -> Any:
    """A Hugging Face family's modules kept in float (HFFamily.float_modules: embeddings, output head)
    joined to the config's skip patterns, for the module schemes; other models' configs unchanged."""
    family = _family(model)
    if family is None or is_block_scheme(config):
        return config
    return replace(config, skip=(*family.float_modules, *(p for p in config.skip if p not in family.float_modules)))


def _calibration(model: nn.Module, config: Any, assets: Mapping[str, bytes], source: str) -> list[Any] | None:
    """gptq's calibration batches for a Hugging Face model: the standard library's train split (as QAT and
    fine-tuning train on, pipeline/lm_train.py) tokenized with the folder's own tokenizer, in windows of
    CALIBRATION_TOKENS;
    None for other schemes and for reference models (gptq takes their training split)."""
    if type(config).scheme != "gptq" or _family(model) is None:
        return None
    if "tokenizer.json" not in assets:
        raise ConfigError(f"{source}: gptq calibrates a Hugging Face model on text tokenized with its folder's "
                          "tokenizer.json, and this input has none; copy the tokenizer files in, or use int4")
    import torch

    from modelkit.models import _hf
    from modelkit.pipeline.lm_train import token_windows, training_text

    wanted = config.calibration_samples * CALIBRATION_TOKENS
    text, _ = training_text(max_bytes=wanted * 8)                      # ~2-4 bytes a token
    blocks = token_windows(_hf.tokenizer(assets, source=source), text, CALIBRATION_TOKENS,
                           vocab=int(model.config.vocab_size), source=f"{source}: gptq calibration")   # (windows, T)
    windows = len(blocks)
    order = torch.randperm(windows, generator=torch.Generator().manual_seed(config.seed))[:config.calibration_samples]
    return list(blocks[order].split(config.batch_size))


def save_quantized(model: nn.Module, dst: PathLike, *, config: Any, format: str | None = None, force: bool = False,
                   metadata: dict[str, str] | None = None, verify: bool = True,
                   assets: Mapping[str, bytes] | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Write a quantized model, read it back and check it: the stored tensors bit for bit, the
    model rebuilt from the file against `model` on sample inputs (identical outputs expected),
    and for graph formats the file run by its runtime (within RUNTIME_RTOL).

    `assets` (a Hugging Face folder's tokenizer files) travel to outputs that hold them (hf).
    Returns (target info, verification result).
    """
    from modelkit.testing import compare_outputs

    dst = Path(dst)
    fmt = format_for_output(dst, format)
    meta = {**{k: v for k, v in (metadata or {}).items() if k != FILE_TYPE_KEY}, QUANT_KEY: schemes.config_to_json(config)}
    if getattr(config, "recipe", ""):                       # llama.cpp's file type, as general.file_type
        from modelkit.quantizers.gguf_recipes import RECIPES

        meta[FILE_TYPE_KEY] = str(RECIPES[config.recipe].ftype)
    ckpt = Checkpoint.from_module(model, metadata=meta)
    ckpt = Checkpoint(ckpt.tensors, ckpt.metadata, ckpt.arch, dict(assets or {}))
    if fmt == "gguf":
        ckpt = _as_gguf_blocks(ckpt)

    def rebuilt_model(tmp: Path, written: Checkpoint) -> dict[str, Any]:
        inputs = _check_inputs(model)
        if inputs is None:
            return {}
        rebuilt = instantiate(written, source=str(dst))
        reference, candidate = _comparable(model.cpu().eval()), _comparable(rebuilt)
        compared = compare_outputs(reference, candidate, inputs, label=f"{dst} (rebuilt)")
        checks: dict[str, Any] = {"rebuilt_outputs": "identical", "max_abs_err": compared["max_abs_err"]}
        if FORMATS[fmt].has_graph:          # the file's own runtime runs the graph it holds
            run = load_format(fmt).runnable(tmp, ReadOptions(trust=True))
            checks["runtime"] = _check_runtime(model, run, inputs, scheme=type(config).scheme, label=str(dst))
        return checks

    # module=None: the graph check against a float module does not apply; rebuilt_model does it
    result, size = write_checkpoint(ckpt, dst, fmt, WriteOptions(final_path=dst), force=force, verify=verify,
                                    module=None, also=rebuilt_model)
    return {"path": str(dst), "format": fmt, "bytes": size}, result


def _check_inputs(model: nn.Module) -> list[tuple[Any, ...]] | None:
    """Inputs the written model is checked on: a Hugging Face causal LM's token batches (input_ids,
    attention_mask, position_ids; modelkit.testing.causal_lm), a reference model's own example; None
    for anything else (nothing to run it on)."""
    from modelkit.testing import causal_lm

    if causal_lm.is_causal_lm(model):
        return causal_lm.check_inputs(model, kv_cache=False)
    name = getattr(type(model), "arch", None)
    if name is None:
        return None
    from modelkit.models import load_model_module

    return [(load_model_module(name).example_inputs(3),)]


def _comparable(model: nn.Module) -> Callable[..., Any]:
    """What the checks compare: a causal LM's logits at real tokens (causal_lm.Compared), else the model."""
    from modelkit.testing import causal_lm

    return causal_lm.Compared(causal_lm.graph(model, kv_cache=False)) if causal_lm.is_causal_lm(model) else model


def _check_runtime(model: nn.Module, run: Callable[..., Any], inputs: list[tuple[Any, ...]], *, scheme: str,
                   label: str) -> dict[str, Any]:
    """A graph file run by its runtime (onnxruntime) against the quantized torch model, within
    RUNTIME_RTOL[scheme] (default RUNTIME_RTOL[None]) of the largest output."""
    from modelkit.pipeline.verify import verify_outputs
    from modelkit.testing import causal_lm

    rtol = RUNTIME_RTOL.get(scheme, RUNTIME_RTOL[None])
    candidate = causal_lm.candidate(run) if causal_lm.is_causal_lm(model) else run
    return verify_outputs(_comparable(model), candidate, inputs, rtol=rtol, label=f"{label} (onnxruntime)")


def _as_gguf_blocks(ckpt: Checkpoint) -> Checkpoint:
    """Affine tensors that are exactly a GGUF block type (symmetric int4 g32 = Q4_0) in that form."""
    from modelkit.quantizers.gguf_blocks import from_affine

    tensors = {}
    for name, entry in ckpt.tensors.items():
        blocks = from_affine(entry) if isinstance(entry, QuantizedTensor) else None
        tensors[name] = blocks if blocks is not None else entry
    return Checkpoint(tensors, ckpt.metadata, ckpt.arch)


# Graph files quantized by their runtime's own tool: suffix -> (format, its name, the tool, "module:function").
_GRAPH_TOOLS = {
    ".onnx": ("onnx", "ONNX", "onnxruntime's own quantizer", "modelkit.pipeline.onnx_quantize:quantize_onnx"),
    ".xml": ("openvino", "OpenVINO IR", "NNCF's weight compression", "modelkit.pipeline.openvino_quantize:quantize_openvino"),
}


def quantize(
    src: PathLike | nn.Module, dst: PathLike | None, *, scheme: str | Any, group_size: int | None = None,
    skip: Sequence[str] = (), format: str | None = None, qat: bool = False, epochs: int = 1, lr: float | None = None,
    steps: int | None = None, evaluate: bool = False, latency: bool | None = None, verify: bool = True,
    force: bool = False, reference: dict[str, Any] | None = None, progress: Callable[..., None] | None = None,
    source_format: str | None = None, trust: bool = False, key: str | None = None, arch: ArchSpec | str | None = None,
    imatrix: PathLike | None = None,
    allow_requantize: bool = False,
    data: PathLike | None = None,
) -> QuantizeReport | None:
    """Quantize a model file (or module) with one scheme, write it, and measure the cost.

    Args:
        src: A float model file any reader handles (with an ArchSpec), a Hugging Face folder, or an nn.Module.
        dst: Output file; its format comes from `format` or the suffix (None: measure only). A Hugging
            Face folder's `dst` whose suffix names no format is a folder ("hf": compressed-tensors'
            layout, docs/formats/hf.md); its family's embeddings and output head stay float.
        scheme: A name from modelkit.schemes.SCHEMES or a config object.
        group_size: int4 / gptq group size.
        skip: fnmatch patterns of module names kept in float.
        qat: Train with fake quantization first (int8, int4, int8-dynamic), then convert.
        epochs, lr, steps: QAT training length (epochs, peak learning rate, steps per epoch).
        data: QAT of a Hugging Face language model: train on this UTF-8 text file instead of the standard
            library's train split (pipeline/lm_train.py).
        evaluate: Measure the model's own metric (accuracy, bits per byte) before and after.
        latency: Measure CPU latency at batch 1 and 64 (default: with `evaluate`).
        verify: Read the written file back and check it rebuilds the same model.
        force: Overwrite `dst`.
        reference: Float metric and latency measured earlier (comparison runs measure them once).
        progress: QAT training progress callback; for a weight file quantized to GGUF without a
            model (quantize_weights), called with (bytes written, total) instead.
        source_format, trust, key, arch: how to read `src`, as for `load_module`.
        imatrix: a llama.cpp importance-matrix file (GGUF block schemes; `modelkit imatrix` makes one):
            weights it has an entry for are quantized under it, as llama-quantize --imatrix does.
        allow_requantize: Accept a file that is already quantized (GGUF block types): its weights are
            dequantized and quantized again, as llama-quantize --allow-requantize does; refused otherwise.

    Returns:
        The report; None on ranks other than 0 when QAT runs under torchrun (rank 0 writes).

    Example:
        >>> report = modelkit.quantize("runs/cnn/model.safetensors", "cnn-int8.safetensors",
        ...                            scheme="int8", evaluate=True)                        # doctest: +SKIP
        >>> report.metric["delta"]                                                          # doctest: +SKIP
        0.0
    """
    graph_tool = _GRAPH_TOOLS.get(Path(src).suffix.lower()) if isinstance(src, (str, os.PathLike)) else None
    if graph_tool is not None:         # a graph file quantized by its runtime's own tool
        fmt, label, tool, target = graph_tool
        ignored = [flag for flag, given in (("--qat", qat), ("--epochs", epochs != 1), ("--steps", steps is not None),
                                            ("--lr", lr is not None), ("--to", format not in (None, fmt)),
                                            ("--imatrix", imatrix is not None), ("--data", data is not None))
                   if given]
        if ignored:
            raise ConfigError(f"{src}: {', '.join(ignored)} do not apply to {label} input, which {tool} handles; "
                              "quantize the torch checkpoint for those")
        module, _, function = target.partition(":")
        run = getattr(importlib.import_module(module), function)
        return run(src, dst, scheme=scheme, group_size=group_size, skip=tuple(skip), evaluate=evaluate,
                   latency=latency, verify=verify, force=force, reference=reference)
    config = make_config(scheme, group_size=group_size, skip=skip,
                         **({"imatrix": os.fspath(imatrix)} if imatrix is not None else {}))
    if qat:                     # before anything is read: QAT trains affine int8/int4 weights only
        from modelkit.quantizers.qat import check_config

        check_config(config)
    elif data is not None:
        raise ConfigError("--data is the text QAT trains on; it applies with --qat")
    is_file = isinstance(src, (str, os.PathLike))
    if dst is not None:          # "out" of a Hugging Face folder is a folder (format_for_output)
        format = format_for_output(dst, format, source=source_format or (detect_format(src) if is_file else None))
    weights_only = (is_file and dst is not None and is_block_scheme(config) and arch is None
                    and not (qat or evaluate or latency) and format == "gguf")
    if weights_only:        # no model needed, unless the file names one (then the model picks its layers)
        report = quantize_weights(src, dst, config=config, source_format=source_format, trust=trust, key=key,
                                  force=force, verify=verify, progress=progress, allow_requantize=allow_requantize)
        if report is not None:
            return report
    from modelkit.pipeline import distributed

    loaded = _load_float(src, source_format=source_format, trust=trust, key=key, arch=arch,
                         allow_requantize=allow_requantize)
    model, source, metadata = loaded.model, loaded.info, loaded.metadata
    if data is not None and _family(model) is None:         # before anything is measured or trained
        raise ConfigError(f"{type(model).__name__} trains on its own task's data; --data applies to QAT of Hugging "
                          "Face language models")
    config = _family_defaults(config, model)
    tokenizer = _text_tokenizer(loaded, src, "--eval measures") if evaluate else None   # before anything is written
    if (evaluate or latency) and reference is None:
        reference = measure_float(model, evaluate=evaluate, latency=bool(latency or evaluate), tokenizer=tokenizer)
    if is_tfjs_scheme(config):
        if qat:
            raise ConfigError(f"--qat does not apply to {config.scheme}, TF.js's encoding of the trained weights")
        report, decoded = _quantize_tfjs(loaded, dst, config, format=format, force=force, verify=verify)
        if evaluate or latency:
            _measure(report, decoded, reference, evaluate=evaluate, latency=bool(latency or evaluate))
        return report
    started = time.perf_counter()
    notes = []
    if qat and _family(model) is not None:       # a Hugging Face language model: trained on text
        quantized, trained = train_qat_lm(model, config, _text_tokenizer(loaded, src, "QAT trains"), epochs=epochs,
                                          lr=lr, steps=steps, data=data, progress=progress)
        notes.append(f"QAT: {trained['epochs']} epoch(s) of {trained['steps'] // trained['epochs']} steps at lr "
                     f"{trained['lr']:g} on {trained['tokens']:,} tokens of {trained['text']} in "
                     f"{trained['context']}-token windows (last epoch's mean train loss {trained['train_loss'][-1]:.4f})")
    elif qat:
        quantized = train_qat(model, config, epochs=epochs, lr=lr, steps=steps, progress=progress, data=data)
        notes.append(f"QAT: {epochs} epoch(s){f' of {steps} steps' if steps else ''} at lr {lr or 'recipe/10'}")
    else:
        calibration = _calibration(model, config, loaded.assets, str(src))
        quantized = quantize_module(model, config, calibration=calibration)
    if qat and not distributed.from_environment().is_main:
        return None                     # under torchrun every rank trains; rank 0 writes and reports
    seconds = time.perf_counter() - started
    ckpt = Checkpoint.from_module(quantized)
    float_ckpt = Checkpoint.from_module(model)
    target, verified = {"path": None, "format": None, "bytes": None}, None
    if dst is not None:
        target, verified = save_quantized(quantized, dst, config=config, format=format, force=force,
                                          metadata=metadata, verify=verify, assets=loaded.assets)
    stats = checkpoint_stats(ckpt)
    ratio = round(ckpt.nbytes / max(float_ckpt.nbytes, 1), 4)
    if target["bytes"] is not None:
        overhead = target["bytes"] - ckpt.nbytes                  # header and metadata, the same for the float file
        float_bytes = source.get("bytes") if source.get("format") == target["format"] else float_ckpt.nbytes + overhead
        ratio = round(target["bytes"] / max(float_bytes or 1, 1), 4)
    report = QuantizeReport(scheme=type(config).scheme, config=schemes.config_to_dict(config), source=source,
                            target=target, stats=stats, seconds_quantize=round(seconds, 3), size_ratio=ratio,
                            verify=verified, notes=notes)
    if evaluate or latency:
        _measure(report, quantized, reference, evaluate=evaluate, latency=bool(latency or evaluate), tokenizer=tokenizer)
        if tokenizer is not None:
            report.notes.append(f"bits per byte on the first {LM_EVAL_TOKENS:,} tokens of the held-out text "
                                "(modelkit eval --split val), with the model's own tokenizer")
    return report


def _quantize_tfjs(loaded: _Source, dst: PathLike | None, config: Any, *, format: str | None, force: bool,
                   verify: bool) -> tuple[QuantizeReport, nn.Module]:
    """TensorFlow.js's uint8/uint16 weights (quantize_weights.tfjs_checkpoint). The model TF.js runs is the
    float model with the decoded weights: that is the quantized model measured, and the written file read
    back must rebuild it exactly (its weights decoded bit for bit as TF.js decodes them)."""
    from modelkit.testing import compare_outputs

    if dst is not None and format != "tfjs":
        raise ConfigError(f"{config.scheme} is TensorFlow.js's own weight encoding: write a TF.js model "
                          f"(DIR/model.json or --to tfjs), not {format}")
    model = loaded.model.cpu().eval()
    started = time.perf_counter()
    ckpt = tfjs_checkpoint(Checkpoint.from_module(model, metadata=loaded.metadata), config)
    quantized = instantiate(ckpt, source=str(loaded.info.get("path", "model")), dequantize=True)
    seconds = time.perf_counter() - started
    float_bytes = Checkpoint.from_module(model).nbytes
    inputs = _check_inputs(model)
    notes = [f"every float weight as {config.bits}-bit codes with its own min and scale in model.json; TF.js decodes "
             "them to float32 on load"]
    checks: dict[str, Any] = {}
    if inputs is not None:               # the quantization error, as the model's outputs show it
        error = compare_outputs(model, quantized, inputs, atol=float("inf"), label=str(dst))
        checks = {"max_abs_err_vs_float": error["max_abs_err"], "max_relative_err_vs_float": error["max_relative_err"]}
    target, verified = {"path": None, "format": None, "bytes": None}, None
    if dst is not None:
        def rebuilt_model(tmp: Path, written: Checkpoint) -> dict[str, Any]:
            if inputs is None:
                return checks
            rebuilt = instantiate(written, source=str(dst))
            compared = compare_outputs(quantized, rebuilt, inputs, label=f"{dst} (rebuilt)")
            return {"rebuilt_outputs": "identical", "max_abs_err": compared["max_abs_err"], **checks}

        verified, size = write_checkpoint(ckpt, dst, "tfjs", WriteOptions(final_path=Path(dst)), force=force,
                                          verify=verify, module=None, also=rebuilt_model)
        target = {"path": str(dst), "format": "tfjs", "bytes": size}
    stats = checkpoint_stats(ckpt)
    ratio = round(stats["tensor_bytes"] / max(float_bytes, 1), 4)
    if target["bytes"] is not None:      # model.json and the float weights' shards would differ only in the weights
        ratio = round(target["bytes"] / max(target["bytes"] - ckpt.nbytes + float_bytes, 1), 4)
    return QuantizeReport(scheme=config.scheme, config=schemes.config_to_dict(config), source=loaded.info,
                          target=target, stats=stats, seconds_quantize=round(seconds, 3), size_ratio=ratio,
                          verify=verified if verified is not None else (checks or None), notes=notes), quantized


# A Hugging Face language model's --eval: bits per byte on this many tokens of the held-out text (the
# whole split is about 70,000 tokens for a 32k vocabulary: minutes for a 1B model on a CPU, twice).
LM_EVAL_TOKENS = 8192


def measure_float(model: nn.Module, *, evaluate: bool = True, latency: bool = True, tokenizer: Any = None) -> dict[str, Any]:
    """The float model's metric and latency, for comparison with each scheme (a Hugging Face language
    model: bits per byte with `tokenizer`, lower is better)."""
    from modelkit.models import load_model_module
    from modelkit.pipeline.measure import arch_name, latencies

    if _family(model) is not None:
        out: dict[str, Any] = {"metric_name": "bits_per_byte", "higher_is_better": False}
    else:
        task = load_model_module(arch_name(model)).TASK
        out = {"metric_name": task.metric, "higher_is_better": task.higher_is_better}
    if evaluate:
        out["metric"] = _evaluate(model, tokenizer)
    if latency:
        out["latency_ms"] = latencies(model)
    return out


def _evaluate(model: nn.Module, tokenizer: Any) -> dict[str, Any]:
    from modelkit.pipeline import measure

    if tokenizer is None:
        return measure.evaluate(model, device="cpu")
    return measure.evaluate(model, device="cpu", tokenizer=tokenizer, max_tokens=LM_EVAL_TOKENS)


def _measure(report: QuantizeReport, quantized: nn.Module, reference: dict[str, Any], *, evaluate: bool,
             latency: bool, tokenizer: Any = None) -> None:
    from modelkit.pipeline.measure import latencies, metric_change

    if evaluate:
        name = reference["metric_name"]
        after = _evaluate(quantized, tokenizer)
        report.metric = metric_change(name, reference["higher_is_better"], reference["metric"], after)
    if latency:
        report.latency_ms = {"float": reference["latency_ms"], "quantized": latencies(quantized)}


def compare(src: PathLike, out_dir: PathLike, *, scheme_names: Sequence[str], format: str = "safetensors",
            evaluate: bool = True, force: bool = False, schemes_done: Callable[[int, int], None] | None = None,
            **options: Any) -> list[QuantizeReport]:
    """Run several schemes on one model (float metric and latency measured once), one file each.

    Files are `out_dir/<scheme>.<suffix>`; `options` go to `quantize` (group_size, skip, qat, ...).
    `schemes_done(done, total)` is called after each scheme (the CLI's progress display).
    """
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    reference = None
    if evaluate and str(src).endswith(".onnx"):
        from modelkit.pipeline.onnx_quantize import float_reference

        reference = float_reference(src)
    elif evaluate:
        reading = {k: options[k] for k in ("source_format", "trust", "key", "arch", "allow_requantize") if k in options}
        loaded = _load_float(src, **reading)
        reference = measure_float(loaded.model, tokenizer=_text_tokenizer(loaded, src))
    suffix = ".onnx" if str(src).endswith(".onnx") else next(iter(FORMATS[format].suffixes), "")   # hf: a folder each
    reports = []
    for done, name in enumerate(scheme_names, start=1):
        fmt = None if suffix == ".onnx" else format
        report = quantize(src, folder / f"{name}{suffix}", scheme=name, format=fmt, evaluate=evaluate,
                          force=force, reference=reference, **options)
        if report is not None:           # None: a rank other than 0 under torchrun (QAT)
            reports.append(report)
        if schemes_done is not None:
            schemes_done(done, len(scheme_names))
    return reports


def report_json(reports: Sequence[QuantizeReport]) -> str:
    return json.dumps([r.to_dict() for r in reports], indent=2, default=str)


def describe(entry: QuantizedTensor | LazyTensor) -> str:
    """'int4 affine g32' / 'q4_0 gguf' / 'float32': one word on how a tensor is stored."""
    if isinstance(entry, QuantizedTensor):
        group = entry.params.get("group_size")
        return f"{entry.scheme} {entry.layout}" + (f" g{group}" if group else "")
    return str(entry.dtype).removeprefix("torch.")


def plot_reports(reports: Sequence[QuantizeReport], path: Path, *, title: str = "") -> Path:
    """Draw each scheme's metric (or, without --eval, bits per weight) against its size ratio as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError as e:
        from modelkit.errors import MissingDependencyError

        raise MissingDependencyError("--plot needs matplotlib: pip install matplotlib") from e
    figure, axes = plt.subplots(figsize=(6, 4), dpi=120)
    metric = next((r.metric for r in reports if r.metric), None)
    for index, r in enumerate(reports):
        y = r.metric["quantized"] if r.metric else r.stats.get("bits_per_weight")
        axes.scatter([r.size_ratio], [y], zorder=3)
        axes.annotate(r.scheme, (r.size_ratio, y), textcoords="offset points", fontsize=8,
                      xytext=(4, 5 if index % 2 == 0 else -11))          # alternate, so close points stay legible
    if metric is not None:
        axes.axhline(metric["float"], color="gray", linestyle="--", linewidth=1, label="float")
        axes.legend(loc="best", fontsize=8)
    axes.set_xlabel("size (fraction of float)")
    axes.set_ylabel(metric["name"].replace("_", " ") if metric else "bits per weight")
    axes.set_title(title or "quantization: metric against size")
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    try:
        write_output(path, lambda tmp: figure.savefig(tmp, format="png"), verify=None, force=True)  # a picture: nothing to verify
    finally:
        plt.close(figure)
    return path
