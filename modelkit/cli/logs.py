"""Log lines on stderr for -v/-vv, standard library only (the click group and `modelkit scan` share it)."""
from __future__ import annotations

import sys


def configure_logging(verbose: int, quiet: bool = False) -> None:
    """modelkit's loggers to stderr: WARNING by default, INFO at -v, DEBUG at -vv, ERROR with -q."""
    import logging  # here, not at the top: `modelkit scan` imports logging only when asked for logs

    level = logging.WARNING - 10 * verbose if not quiet else logging.ERROR
    logger = logging.getLogger("modelkit")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(max(level, logging.DEBUG))
