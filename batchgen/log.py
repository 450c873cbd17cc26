"""The `batchgen` logger: its level and the one handler it may own.

Library convention: the application's logging configuration wins. batchgen's INFO lines (the
capacity line) show by default; `BATCHGEN_LOG_LEVEL` (e.g. WARNING) or the application's own
`logging.getLogger("batchgen").setLevel(...)` changes that. The fallback handler writes only
while the root logger has no handler, so under `logging.basicConfig()` (called before or after
`LLM(...)`) every line prints once, through the application's handler.
"""

from __future__ import annotations

import logging
import os

LOG_LEVEL_ENV = "BATCHGEN_LOG_LEVEL"
logger = logging.getLogger("batchgen")


class _FallbackHandler(logging.StreamHandler):
    """Writes to stderr only when the application configured no root handler."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def configure_logging() -> None:
    """Set the library's level (unless the application set it) and attach the fallback handler
    once; idempotent, called by `LLM.__init__`, never at import."""
    if logger.level == logging.NOTSET:
        level = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
        if not isinstance(logging.getLevelName(level), int):
            raise ValueError(f"{LOG_LEVEL_ENV} must be one of DEBUG, INFO, WARNING, ERROR, "
                             f"CRITICAL, got {level!r}")
        logger.setLevel(level)
    if not any(isinstance(h, _FallbackHandler) for h in logger.handlers):
        handler = _FallbackHandler()
        handler.setFormatter(logging.Formatter("[batchgen] %(message)s"))
        logger.addHandler(handler)
