"""Prune and distill model files: the API behind `modelkit prune` and `modelkit distill`.

The transforms themselves live in `modelkit.quantizers.prune` and `modelkit.quantizers.distill`
and work on modules; this module reads and writes files, measures, and fine-tunes through the
zoo's training loop (so torchrun DDP works here too).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from modelkit.checkpoint import Checkpoint
from modelkit.errors import ConfigError, UnsupportedConversionError
from modelkit.metadata import DISTILL_KEY, METRICS_KEY, PRUNE_KEY
from modelkit.pipeline import distributed
from modelkit.pipeline.measure import evaluate

PathLike = str | os.PathLike[str]

def _arch_name(model: nn.Module) -> str:
    name = getattr(type(model), "arch", None)
    if name is None:
        raise UnsupportedConversionError(type(model).__name__, "prune/distill report",
                                         "metrics and fine-tuning need a reference model (mlp, cnn, tinylm)")
    return name


def _parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _file_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


@dataclass
class PruneReport:
    source: str
    target: str
    config: dict[str, Any]
    metric: str
    parameters: dict[str, int]          # before / after
    bytes: dict[str, int]               # before / after
    values: dict[str, float | None]     # metric before / after pruning / after fine-tuning
    layers: list[dict[str, Any]] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)   # structured: units the family cannot remove, and why
    finetune_epochs: int = 0
    finetune: dict[str, Any] | None = None  # a language model's fine-tuning: steps, tokens, text, lr, train loss
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def finetune(model: nn.Module, *, epochs: int, lr: float | None = None, seed: int = 0, device: str = "auto",
             keep_zeros: bool = True, progress=None, steps: int | None = None, tokenizer: Any = None,
             data: PathLike | None = None) -> dict[str, Any] | None:
    """Train `model` in place for a few epochs, keeping pruned weights at zero; the model ends on the CPU in eval mode.

    A reference model trains with its own recipe on its own task (`data` is refused). A Hugging Face causal
    LM trains on text with `pipeline.lm_train` (next-token loss on windows of `tokenizer`'s ids: `data`, or the
    standard library's train split; lr default lm_train.TRAIN_LR) and its training summary is returned.
    `steps` stops each epoch after that many steps.
    """
    from modelkit.models import hf_config_of
    from modelkit.pipeline.lm_train import LMTrainConfig, train_causal_lm
    from modelkit.pipeline.train import TrainConfig, train
    from modelkit.quantizers.prune import keep_masks

    language_model = hf_config_of(model) is not None
    if not language_model:
        name = _arch_name(model)
        if data is not None:
            raise ConfigError(f"{name} fine-tunes on its own task's data; --data applies to Hugging Face language models")
    handles = keep_masks(model) if keep_zeros else []
    summary = None
    try:
        if language_model:
            summary = train_causal_lm(model, tokenizer, LMTrainConfig(epochs=epochs, steps_per_epoch=steps, lr=lr,
                                                                      seed=seed, device=device),
                                      data=data, progress=progress)
        else:
            with tempfile.TemporaryDirectory(prefix="modelkit-finetune-") as scratch:
                train(name, scratch, model=model, progress=progress,
                      config=TrainConfig(epochs=epochs, lr=lr, seed=seed, device=device, steps_per_epoch=steps))
    finally:
        for handle in handles:
            handle.remove()
    model.cpu().eval()
    return summary


def prune_file(src: PathLike, dst: PathLike, config: Any, *, finetune_epochs: int = 0, lr: float | None = None,
               seed: int = 0, device: str = "auto", force: bool = False, progress=None,
               source_format: str | None = None, trust: bool = False, key: str | None = None,
               arch: str | None = None, max_tokens: int | None = None, to: str | None = None,
               steps: int | None = None, data: PathLike | None = None) -> PruneReport | None:
    """Prune the model in `src`, optionally fine-tune it, and save it to `dst` (any format by suffix).

    `source_format`, `trust`, `key` and `arch` say how to read `src`, as for `load_module`; `to` names the
    output format (default: from `dst`'s suffix).

    A Hugging Face family's causal LM (a folder, a GGUF of one) is measured in bits per byte on the default
    held-out text (`evaluate`; `max_tokens` caps it) with its own tokenizer, before and after; its
    tokenizer files travel to `dst`. Its fine-tuning trains on text (`finetune`: `data`, or the standard
    library's train split, never the held-out text it is measured on). `steps` stops each fine-tuning epoch
    after that many steps.

    Under torchrun every rank prunes and fine-tunes (DDP); rank 0 writes `dst` and gets the
    report, the other ranks get None.

    Example:
        >>> from modelkit.quantizers.prune import PruneConfig
        >>> report = prune_file("runs/cnn/model.safetensors", "cnn-pruned.safetensors",        # doctest: +SKIP
        ...                     PruneConfig(method="structured", sparsity=0.5), finetune_epochs=10)
    """
    from modelkit.formats import FORMATS, WriteOptions, detect_format, format_for_output
    from modelkit.models import hf_config_of
    from modelkit.pipeline.load import load_language_model
    from modelkit.pipeline.write import write_checkpoint
    from modelkit.quantizers import prune

    started = time.perf_counter()
    src, dst = Path(src), Path(dst)
    # a quantized file (GGUF blocks, int8/int4) is pruned as its float model: pruning slices plain weights
    loaded = load_language_model(src, format=source_format, trust=trust, key=key, arch=arch, dequantize=True)
    model = loaded.model
    if data is not None and not finetune_epochs:
        raise ConfigError("--data is the text fine-tuning trains on; it applies with --finetune-epochs")
    if hf_config_of(model) is not None:
        if finetune_epochs and loaded.tokenizer is None:
            raise ConfigError(f"{src}: fine-tuning a language model trains on text with its own tokenizer, and this "
                              "model carries no tokenizer.json; copy the tokenizer files into its folder")

        def measure(m: nn.Module) -> dict[str, Any] | None:
            if loaded.tokenizer is None:         # no tokenizer files: the report says so (values None)
                return None
            return evaluate(m, device=device, tokenizer=loaded.tokenizer, max_tokens=max_tokens)

        headline = "bits_per_byte"
    else:
        headline = _headline(_arch_name(model))

        def measure(m: nn.Module) -> dict[str, Any] | None:
            return evaluate(m, device=device)

    before = measure(model)
    pruned = prune.apply(model, config)
    after = measure(pruned)
    tuned, trained = None, None
    if finetune_epochs:
        trained = finetune(pruned, epochs=finetune_epochs, lr=lr, seed=seed, device=device, progress=progress,
                           steps=steps, tokenizer=loaded.tokenizer, data=data)
        tuned = measure(pruned)
    metric = (before["split"] if before else "val") + " " + headline + ("" if before else " (no tokenizer to measure with)")
    final = tuned or after
    metadata = {PRUNE_KEY: json.dumps({**prune.config_dict(config), "finetune_epochs": finetune_epochs})}
    if final is not None:
        metadata[METRICS_KEY] = json.dumps({final["split"]: {k: v for k, v in final.items() if k not in ("model", "split")}})
    if not distributed.from_environment().is_main:
        return None                     # under torchrun only rank 0 writes and reports
    if hf_config_of(pruned) is not None and loaded.weights_dtype in ("float16", "bfloat16"):
        import torch

        pruned = pruned.to(getattr(torch, loaded.weights_dtype))   # the source's type (exact: a subset of its values)
    fmt = format_for_output(dst, to, source=source_format or detect_format(src))   # a folder's "out": a folder
    module = pruned if FORMATS[fmt].has_graph else None      # a graph's outputs are checked against the pruned model
    ckpt = Checkpoint.from_module(pruned, metadata=metadata)
    ckpt.assets = dict(loaded.assets)   # the tokenizer and generation files travel to a folder or GGUF
    write_checkpoint(ckpt, dst, fmt, WriteOptions(module=module, final_path=dst), force=force, module=module)
    return PruneReport(
        source=str(src), target=str(dst), config=prune.config_dict(config), metric=metric,
        parameters={"before": _parameters(model), "after": _parameters(pruned)},
        bytes={"before": _file_bytes(src), "after": _file_bytes(dst)},
        values={"before": before and before[headline], "after": after and after[headline],
                "finetuned": tuned[headline] if tuned else None},
        layers=prune.sparsity_report(pruned), finetune_epochs=finetune_epochs, finetune=trained,
        kept=prune.kept_units(model) if config.method == "structured" else [],
        seconds=time.perf_counter() - started,
    )


def _headline(name: str) -> str:
    from modelkit.models import load_model_module

    return load_model_module(name).TASK.metric


def parse_student(spec: str, teacher_arch: str) -> tuple[str, dict[str, Any]]:
    """'cnn' -> the default student; 'cnn:channels=[8,16],hidden=32' or 'cnn:{"hidden": 32}' -> that config."""
    name, _, rest = spec.partition(":")
    if name != teacher_arch:
        raise ConfigError(f"student {name!r} must be the teacher's kind of model ({teacher_arch!r}): "
                          "they learn the same task from the same data")
    if not rest:
        from modelkit.models import load_model_module

        return name, dict(load_model_module(name).STUDENT)
    if rest.lstrip().startswith("{"):
        try:
            values = json.loads(rest)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--student {spec!r}: the config is not valid JSON ({e})") from e
        return name, values
    values = {}
    for item in re.split(r",(?![^\[]*\])", rest):          # commas outside [...] separate keys
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--student {spec!r}: expected KEY=VALUE pairs after the colon, got {item!r}")
        try:
            values[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            values[key.strip()] = raw
    return name, values


@dataclass
class DistillReport:
    teacher: dict[str, Any]
    student: dict[str, Any]
    scratch: dict[str, Any] | None
    config: dict[str, Any]
    metric: str
    higher_is_better: bool
    epochs: int
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def distill_file(teacher: PathLike, student: str, out: PathLike, config: Any = None, *, epochs: int | None = None,
                 seed: int = 0, device: str = "auto", baseline: bool = True, force: bool = False,
                 progress=None, source_format: str | None = None, trust: bool = False, key: str | None = None,
                 arch: str | None = None) -> DistillReport | None:
    """Train a student on the teacher's soft targets; with `baseline`, also the same student from scratch.

    `source_format`, `trust`, `key` and `arch` say how to read `teacher`, as for `load_module`.

    `config` None takes the teacher's model's measured defaults (quantizers.distill.default_config).
    Under torchrun every rank trains (DDP); rank 0 gets the report, the other ranks get None.

    Writes OUT/student/model.safetensors (and OUT/scratch/model.safetensors for the baseline).
    """
    from modelkit.models import load_model_module
    from modelkit.pipeline.load import load_module
    from modelkit.pipeline.train import TrainConfig, train
    from modelkit.quantizers.distill import DistillationLoss, config_dict, default_config

    started = time.perf_counter()
    out = Path(out)
    teacher_model = load_module(teacher, format=source_format, trust=trust, key=key, arch=arch)
    name = _arch_name(teacher_model)
    student_name, student_config = parse_student(student, name)
    config = config if config is not None else default_config(name)
    task = load_model_module(name).TASK
    recipe = TrainConfig(epochs=epochs, seed=seed, device=device)
    loss = DistillationLoss(teacher_model, config, augment=getattr(task, "augment", None))
    distilled = train(student_name, out / "student", config=recipe, model_config=student_config, loss=loss,
                      force=force, progress=progress,
                      metadata={DISTILL_KEY: json.dumps({**config_dict(config), "teacher": str(teacher)})})
    scratch = None
    if baseline:
        scratch = train(student_name, out / "scratch", config=recipe, model_config=student_config, force=force,
                        progress=progress)
    if not distributed.from_environment().is_main:
        return None                     # rank 0 wrote the files (after the loop's last barrier) and reports
    metric, split = task.metric, task.default_split

    def summary(path: Path, model: nn.Module | None = None) -> dict[str, Any]:
        model = model or load_module(path)
        return {"path": str(path), "parameters": _parameters(model), "bytes": _file_bytes(path),
                "value": evaluate(model, split=split, device=device)[metric]}

    return DistillReport(
        teacher=summary(Path(teacher), teacher_model), student=summary(distilled.path),
        scratch=summary(scratch.path) if scratch else None, config=config_dict(config),
        metric=f"{split} {metric}", higher_is_better=task.higher_is_better,
        epochs=recipe.resolved(name).epochs, seconds=time.perf_counter() - started,
    )

