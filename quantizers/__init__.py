"""Transforms that make a model smaller: one module per scheme, each a config dataclass and apply.

Installed and imported as modelkit.quantizers (see docs/architecture.md).
"""
if __name__ != "modelkit.quantizers":
    raise ImportError(f"import modelkit.quantizers, not {__name__!r} (see docs/architecture.md)")
