"""Numeric checks, shipped so users can verify conversions in their own export scripts.

`compare_outputs` is the one output comparator: every verification modelkit runs (graph exports,
quantized files rebuilt or run by their runtime, ONNX quantization) goes through it, and its
result (the largest error and the bound it was held to) is what the reports carry.
`assert_same_outputs` is its one-call form.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from modelkit.errors import VerificationError

Runnable = Callable[..., torch.Tensor]
Inputs = torch.Tensor | Sequence[torch.Tensor]


def _as_tuple(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    return (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)


def compare_outputs(
    reference: Runnable, candidate: Runnable, inputs: Iterable[Inputs], *, atol: float = 0.0, rtol: float = 0.0,
    label: str = "",
) -> dict[str, Any]:
    """Run both models on each set of `inputs`; raise VerificationError unless every output agrees.

    An output passes when max |reference - candidate| <= atol + rtol * max |reference| (rtol
    scales with the output's magnitude, for quantized models). atol=rtol=0 demands identical outputs.

    Args:
        reference: The model (or runtime) whose outputs are right.
        candidate: The model (or runtime) under test.
        inputs: One entry per call: a tensor or a tuple of positional arguments.
        atol, rtol: The tolerance (see above).
        label: Names the output in error messages (a file path).

    Returns:
        {"method": "outputs", "inputs", "max_abs_err", "max_relative_err" (max_abs_err over the
        largest reference output), "atol", "rtol", "passed": True}.

    Raises:
        VerificationError: with the measured error and the bound it exceeded.

    Example:
        >>> from modelkit.models import build
        >>> model = build("mlp", seed=0).eval()
        >>> compare_outputs(model, model, [torch.zeros(2, 2)])["max_abs_err"]
        0.0
    """
    prefix = f"{label}: " if label else ""
    worst = worst_relative = 0.0
    count = 0
    for entry in inputs:
        args = _as_tuple(entry)
        with torch.no_grad():
            expected_all, actual_all = _outputs(reference(*args)), _outputs(candidate(*args))
        count += 1
        if len(expected_all) != len(actual_all):
            raise VerificationError(f"{prefix}{len(expected_all)} outputs vs {len(actual_all)}",
                                    max_abs_err=float("inf"), atol=atol)
        for expected, actual in zip(expected_all, actual_all, strict=True):
            if expected.shape != actual.shape:
                raise VerificationError(f"{prefix}output shapes differ: {list(expected.shape)} vs {list(actual.shape)}",
                                        max_abs_err=float("inf"), atol=atol)
            err = float((expected - actual).abs().max()) if expected.numel() else 0.0
            largest = float(expected.abs().max()) if expected.numel() else 0.0
            allowed = atol + rtol * largest
            if not err <= allowed:
                raise VerificationError(f"{prefix}outputs differ", max_abs_err=err, atol=allowed)
            worst = max(worst, err)
            worst_relative = max(worst_relative, err / max(largest, 1e-12))
    return {"method": "outputs", "inputs": count, "max_abs_err": worst, "max_relative_err": worst_relative,
            "atol": atol, "rtol": rtol, "passed": True}


def _outputs(result: Any) -> list[torch.Tensor]:
    """A model's output as float tensors: one, or each of a tuple/list of outputs (a multi-output graph)."""
    items = result if isinstance(result, (tuple, list)) else [result]
    return [torch.as_tensor(item).float() for item in items]


def assert_same_outputs(
    reference: Runnable, candidate: Runnable, inputs: Inputs, *, atol: float = 0.0, rtol: float = 0.0,
    label: str = "",
) -> float:
    """Run both models on `inputs`; raise VerificationError unless outputs agree within tolerance.

    atol=0 (the default) demands bit-identical outputs, the bar for lossless weight containers.
    Returns the maximum absolute error. `compare_outputs` does the same over several inputs.

    Example:
        >>> from modelkit.models import build
        >>> model = build("mlp", seed=0).eval()
        >>> assert_same_outputs(model, model, torch.zeros(2, 2))
        0.0
    """
    return compare_outputs(reference, candidate, [inputs], atol=atol, rtol=rtol, label=label)["max_abs_err"]
