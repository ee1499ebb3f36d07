"""Index arithmetic on ragged rows (the offsets of Arrow list columns, packed token streams)."""

from __future__ import annotations

import numpy as np


def ragged_arange(lengths: np.ndarray) -> np.ndarray:
    """concat(arange(n) for n in lengths), without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(lengths.sum(), dtype=np.int64) - starts
