"""File-format converters: one module per format, each with detect, read and write.

Installed and imported as modelkit.converters (see docs/architecture.md).
"""
if __name__ != "modelkit.converters":
    raise ImportError(f"import modelkit.converters, not {__name__!r} (see docs/architecture.md)")
