"""Said once per process: which path an op took, or why it keeps SGLang's. A decode step calls these paths per
layer, so repeating the line would flood the server log."""

from __future__ import annotations

import logging

_said: set = set()


def log_once(logger: logging.Logger, message: str, *args, level: int = logging.INFO) -> None:
    """``logger.log(level, "kt_serve: " + message, *args)`` the first time this message comes (args are not part of
    what makes it new: they describe the first occurrence)."""
    if message not in _said:
        _said.add(message)
        logger.log(level, "kt_serve: " + message, *args)
