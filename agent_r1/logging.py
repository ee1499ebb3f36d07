"""One logger for the project, prefixed by role/rank once the launcher sets them."""

from __future__ import annotations

import logging
import sys
import time

_CONFIGURED = False


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


class Progress:
    """A progress bar on a terminal; in a batch log (no terminal) one plain line every ``every_s``
    seconds instead of hundreds of carriage-return redraws; nothing when disabled. The subset of
    tqdm the trainer uses: ``update``, ``set_postfix``, ``close``, ``n``, iteration."""

    def __init__(self, iterable=None, total=None, desc="", unit="it", enabled=True, every_s=30.0):
        self.iterable, self.desc, self.unit, self.every_s = iterable, desc, unit, every_s
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.n, self.postfix, self.bar = 0, "", None
        self.enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=desc, unit=unit, leave=False)
        self.t0 = self.last = time.time()

    def __iter__(self):
        for x in self.iterable:
            yield x
            self.update(1)

    def update(self, k: int = 1) -> None:
        self.n += k
        if self.bar is not None:
            self.bar.update(k)
        elif self.enabled and time.time() - self.last >= self.every_s:
            self.last = time.time()
            rate = self.n / max(self.last - self.t0, 1e-9)
            of = f"/{self.total}" if self.total else ""
            post = f" {self.postfix}" if self.postfix else ""
            print(f"{self.desc}: {self.n}{of} {self.unit} ({rate:.2f} {self.unit}/s){post}", flush=True)

    def set_postfix(self, **kw) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in kw.items())
        if self.bar is not None:
            self.bar.set_postfix(**kw)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
