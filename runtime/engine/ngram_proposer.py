"""Prompt lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens. No model: when the output copies its input (summaries, edits, code
changes, quoting), the next tokens are already in the context."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens for `tokens` (prompt and output so far): the longest suffix of
    length max_n down to min_n that occurred earlier, continued as it continued there (the
    latest occurrence: the most recent context is the likeliest to repeat). [] when no
    suffix recurs."""
    length = len(tokens)
    if length < min_n + 1 or k < 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n :]
        # Windows starting at 0 .. length - n - 1: each has at least one token after it, and
        # none is the suffix itself.
        windows = sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []
