"""How commands show results: human text or one JSON document on stdout; progress and logs on stderr."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import click

from modelkit.cli.progress import Progress as _Progress
from modelkit.cli.progress import human_bytes as human_bytes  # re-exported for the commands


def is_quiet() -> bool:
    ctx = click.get_current_context(silent=True)
    return bool(ctx and (ctx.find_root().obj or {}).get("quiet"))


def emit_json(doc: Mapping[str, Any]) -> None:
    import json  # here, not at the top: `modelkit scan` without --json never needs it

    click.echo(json.dumps(doc, indent=2, default=str))


def note(message: str) -> None:
    """A status line on stderr (suppressed by -q)."""
    if not is_quiet():
        click.echo(message, err=True)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, align: str | None = None) -> str:
    """A plain text table; `align` has one character per column, 'l' or 'r'."""
    rows = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    align = align or "l" * len(headers)

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(cells, widths, align, strict=False)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def format_metrics(metrics: Mapping[str, Any]) -> str:
    """'accuracy 0.9815, loss 0.0712', 'bits/byte 2.101 (unigram 4.746, 0.44x), perplexity 4.29' or, for a
    tokenized text, 'bits/byte 1.234, perplexity 8.91 per token (20,000 tokens, 3.1 bytes/token, context 512)'."""
    if "bits_per_byte" in metrics and "tokens" in metrics:
        return (f"bits/byte {metrics['bits_per_byte']:.3f}, perplexity {metrics['perplexity']:.2f} per token "
                f"({metrics['tokens']:,} tokens, {metrics['bytes_per_token']:.2f} bytes/token, "
                f"context {metrics['context']})")
    if "bits_per_byte" in metrics:
        return (f"bits/byte {metrics['bits_per_byte']:.3f} (unigram {metrics['unigram_bits_per_byte']:.3f}, "
                f"{metrics['ratio_to_unigram']:.2f}x), perplexity {metrics['perplexity']:.2f}")
    if "accuracy" in metrics:
        return f"accuracy {metrics['accuracy']:.4f}, loss {metrics['loss']:.4f}"
    return ", ".join(f"{k} {v}" for k, v in metrics.items())


class Progress(_Progress):
    """The stderr progress display (modelkit/cli/progress.py), also silenced by the group's -q."""

    def __init__(self, label: str, *, enabled: bool, unit: str = "") -> None:
        super().__init__(label, enabled=enabled and not is_quiet(), unit=unit)
