"""Progress on stderr for long work, standard library only (so `modelkit scan` can use it without click).

A bar redrawn in place when stderr is a terminal; a plain line at every tenth of the work otherwise
(CI logs stay short and readable); nothing when disabled (--json, -q, ranks other than 0).
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping

_WIDTH = 30


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    """Adapts a library progress(done, total, stats) callback for people watching stderr.

    Args:
        label: What is being done ("scanning", "converting").
        enabled: False for --json and -q; ranks other than 0 under torchrun are always quiet.
        unit: "bytes" shows sizes; "" shows counts.
    """

    def __init__(self, label: str, *, enabled: bool, unit: str = "") -> None:
        self.label = label
        self.unit = unit
        self.enabled = enabled and os.environ.get("RANK", "0") == "0"
        self.tty = sys.stderr.isatty()
        self._started = time.monotonic()
        self._drawn = False
        self._next_line = 0
        self._stats: Mapping[str, float] = {}

    def __call__(self, done: int, total: int, stats: Mapping[str, float] | None = None) -> None:
        if not self.enabled:
            return
        self._stats = stats or {}
        if not self.tty:
            if done >= self._next_line:
                self._write(f"{self.label}: {self._amount(done, total)} {self._show_stats()}".rstrip() + "\n")
                self._next_line = min(done + max(total // 10, 1), total) if done < total else total + 1
            return
        fraction = done / total if total else 1.0
        filled = int(_WIDTH * fraction)
        elapsed = time.monotonic() - self._started
        eta = f"  eta {_clock(elapsed / fraction - elapsed)}" if 0 < fraction < 1 and elapsed > 1 else ""
        line = (f"{self.label} [{'#' * filled}{'-' * (_WIDTH - filled)}] {100 * fraction:3.0f}%  "
                f"{self._amount(done, total)}{eta}  {self._show_stats()}").rstrip()
        self._write("\r\x1b[2K" + line)
        self._drawn = True

    def _amount(self, done: int, total: int) -> str:
        return f"{human_bytes(done)}/{human_bytes(total)}" if self.unit == "bytes" else f"{done}/{total}"

    def _show_stats(self) -> str:
        return " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in self._stats.items())

    @staticmethod
    def _write(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    def close(self) -> None:
        if self._drawn:
            self._write("\n")
            self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes:02d}:{seconds:02d}"
