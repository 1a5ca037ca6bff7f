"""What a pipeline step did, as plain records; `to_dict()` gives a command's --json body."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class QuantizeReport:
    """What one scheme did to one model; `to_dict()` is a row of the CLI's --json document."""

    scheme: str
    config: dict[str, Any]
    source: dict[str, Any]
    target: dict[str, Any]
    stats: dict[str, Any]
    seconds_quantize: float
    size_ratio: float | None = None
    metric: dict[str, Any] | None = None           # {"name", "higher_is_better", "float", "quantized", "delta"}
    latency_ms: dict[str, dict[str, float]] | None = None   # {"float": {"batch_1": ..}, "quantized": {...}}
    verify: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
