"""Numeric checks, shipped so users can verify conversions in their own export scripts."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from modelkit.errors import VerificationError

Runnable = Callable[..., torch.Tensor]


def _as_tuple(inputs: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)


def assert_same_outputs(
    reference: Runnable, candidate: Runnable, inputs: torch.Tensor | Sequence[torch.Tensor], *,
    atol: float = 0.0, rtol: float = 0.0,
) -> float:
    """Run both models on `inputs`; raise VerificationError unless outputs agree within tolerance.

    atol=0 (the default) demands bit-identical outputs, the bar for lossless weight containers.
    Returns the maximum absolute error.

    Example:
        >>> from modelkit.models import build
        >>> model = build("mlp", seed=0).eval()
        >>> assert_same_outputs(model, model, torch.zeros(2, 2))
        0.0
    """
    args = _as_tuple(inputs)
    with torch.no_grad():
        expected = torch.as_tensor(reference(*args)).float()
        actual = torch.as_tensor(candidate(*args)).float()
    if expected.shape != actual.shape:
        raise VerificationError(f"output shapes differ: {list(expected.shape)} vs {list(actual.shape)}",
                                max_abs_err=float("inf"), atol=atol)
    err = float((expected - actual).abs().max()) if expected.numel() else 0.0
    allowed = atol + rtol * float(expected.abs().max()) if expected.numel() else atol
    if not err <= allowed:
        raise VerificationError("outputs differ", max_abs_err=err, atol=allowed)
    return err
