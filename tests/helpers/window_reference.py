"""The documented window merge rule (serving/windows.py), written again with plain loops: the
independent reference the windows' tests compare the served and module merges with."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def brute_owner(n: int, spans: Sequence[tuple[int, int]], p: int) -> tuple[int, float]:
    """The documented rule for residue p, with plain loops: among the windows containing p, the
    one with the largest min(left, right) context (a side at the sequence's end is unlimited),
    ties to the earlier window. (window index, its context)."""
    best_window: int | None = None
    best_score: float | None = None
    for index, (start, end) in enumerate(spans):
        if not start <= p < end:
            continue
        left = math.inf if start == 0 else p - start
        right = math.inf if end == n else end - 1 - p
        score = min(left, right)
        if best_score is None or score > best_score:
            best_window, best_score = index, score
    assert best_window is not None and best_score is not None, f"residue {p} lies in no window of {spans}"
    return best_window, best_score


def brute_merge(outputs, spans, has_bos, has_eos):
    n = spans[-1][1]
    bos = 1 if has_bos else 0
    rows = []
    if has_bos:
        rows.append(outputs[0][0])
    for p in range(n):
        window, _ = brute_owner(n, spans, p)
        rows.append(outputs[window][bos + p - spans[window][0]])
    if has_eos:
        start, end = spans[-1]
        rows.append(outputs[-1][bos + end - start])
    return np.stack(rows)
