"""One logger for the project, prefixed by role/rank once the launcher sets them."""

from __future__ import annotations

import logging
import sys

_CONFIGURED = False


def get_logger(name: str = "agent_r1") -> logging.Logger:
    return logging.getLogger(name)


def setup_logging(role: str = "main", level: int = logging.INFO) -> logging.Logger:
    global _CONFIGURED
    root = logging.getLogger("agent_r1")
    if not _CONFIGURED:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter(f"[%(asctime)s {role}] %(message)s", "%H:%M:%S"))
        # `log.info(msg, extra={"console": False})`: for the log files only (already printed)
        h.addFilter(lambda record: getattr(record, "console", True))
        root.addHandler(h)
        root.propagate = False
        _CONFIGURED = True
    root.setLevel(level)
    return root
