"""Prompts that exercise a tokenizer's pre-tokenizer and normalizer: words, code, runs of whitespace, digits,
non-ASCII text and contractions. The tokenizer tests and llama.cpp's recorded verdicts use them."""
from __future__ import annotations

TOKENIZER_PROMPTS = (
    "Hello world",
    "def wrap(text, width=70):\n    return TextWrapper(width=width).wrap(text)\n",
    "  two leading spaces,   runs of   spaces\t\ttabs\n\n\nand newlines  ",
    "numbers 1234567 and 3.14159, 42nd",
    "unicode: café naïve straße Ελληνικά 日本語 🙂 ✓",
    "don't I'll we've THEY'RE",
)
