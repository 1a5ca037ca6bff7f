"""How commands show results: human text or one JSON document on stdout; progress and logs on stderr."""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import click


def is_quiet() -> bool:
    ctx = click.get_current_context(silent=True)
    return bool(ctx and (ctx.find_root().obj or {}).get("quiet"))


def emit_json(doc: Mapping[str, Any]) -> None:
    click.echo(json.dumps(doc, indent=2, default=str))


def note(message: str) -> None:
    """A status line on stderr (suppressed by -q)."""
    if not is_quiet():
        click.echo(message, err=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, align: str | None = None) -> str:
    """A plain text table; `align` has one character per column, 'l' or 'r'."""
    rows = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    align = align or "l" * len(headers)

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(cells, widths, align, strict=False)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def format_metrics(metrics: Mapping[str, Any]) -> str:
    """'accuracy 0.9815, loss 0.0712' or 'bits/byte 2.101 (unigram 4.746, 0.44x), perplexity 4.29'."""
    if "bits_per_byte" in metrics:
        return (f"bits/byte {metrics['bits_per_byte']:.3f} (unigram {metrics['unigram_bits_per_byte']:.3f}, "
                f"{metrics['ratio_to_unigram']:.2f}x), perplexity {metrics['perplexity']:.2f}")
    if "accuracy" in metrics:
        return f"accuracy {metrics['accuracy']:.4f}, loss {metrics['loss']:.4f}"
    return ", ".join(f"{k} {v}" for k, v in metrics.items())


class Progress:
    """Adapts the library's progress(done, total, stats) callback for people watching stderr.

    A bar when stderr is a terminal; a line at every tenth of the work otherwise (CI logs);
    nothing with --json or -q, nor on ranks other than 0 under torchrun.
    """

    def __init__(self, label: str, *, enabled: bool, unit: str = "") -> None:
        self.label = label
        self.unit = unit          # "bytes" shows sizes; "" shows counts
        self.enabled = enabled and not is_quiet() and os.environ.get("RANK", "0") == "0"
        self.tty = sys.stderr.isatty()
        self._bar: Any = None
        self._done = 0
        self._next_line = 0
        self._stats: Mapping[str, float] = {}

    def __call__(self, done: int, total: int, stats: Mapping[str, float] | None = None) -> None:
        if not self.enabled:
            return
        self._stats = stats or {}
        if not self.tty:
            if done >= self._next_line:
                shown = f"{human_bytes(done)}/{human_bytes(total)}" if self.unit == "bytes" else f"{done}/{total}"
                click.echo(f"{self.label}: {shown} {self._show(None)}".rstrip(), err=True)
                self._next_line = min(done + max(total // 10, 1), total) if done < total else total + 1
            return
        if self._bar is None:
            self._bar = click.progressbar(length=total, label=self.label, file=sys.stderr,
                                          item_show_func=self._show, show_eta=True, show_pos=True)
            self._bar.__enter__()
        self._bar.update(done - self._done, current_item=done)
        self._done = done

    def _show(self, _item: Any) -> str:
        return " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in self._stats.items())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
