"""Comparing numeric outputs: the package's one cosine similarity and its check for degenerate rows.

Every place that compares two sets of vectors (the export check of a graph against PyTorch, the
check of a served repository against PyTorch, the benchmarks) uses `cosine_rows`, so that a zero
row or a NaN means the same thing everywhere: a zero row agrees only with a zero row, and a row
with a NaN or an infinity agrees with nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of corresponding rows (vectors along the last axis) of `a` and `b`.

    1.0 where both rows are all zeros (they agree); 0.0 where exactly one of them is all zeros,
    and where either row holds a NaN or an infinity (such a row agrees with nothing, so a
    minimum-cosine check fails on it). Computed in float64, so large fp32 values cannot overflow
    the norms.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"cosine_rows: shapes differ ({a.shape} and {b.shape})")
    return RowSums.of(a, b).cosines()


@dataclass
class RowSums:
    """What cosine_rows needs of corresponding rows, summed over their entries: a row's sums can
    be added up piece by piece (`add`), so a row too long to hold in float64 at once is compared
    in slices of its columns (serving/golden.py's compare)."""

    finite: np.ndarray
    dots: np.ndarray
    squares_a: np.ndarray
    squares_b: np.ndarray

    @classmethod
    def of(cls, a: np.ndarray, b: np.ndarray) -> RowSums:
        """The sums over the last axis of float64 `a` and `b` (a row with NaN or Inf sums as zeros)."""
        finite = np.isfinite(a).all(-1) & np.isfinite(b).all(-1)
        a, b = np.where(finite[..., None], a, 0.0), np.where(finite[..., None], b, 0.0)
        return cls(finite, (a * b).sum(-1), (a * a).sum(-1), (b * b).sum(-1))

    def add(self, other: RowSums) -> RowSums:
        """The sums of the rows' two pieces together."""
        return RowSums(self.finite & other.finite, self.dots + other.dots, self.squares_a + other.squares_a,
                       self.squares_b + other.squares_b)

    def cosines(self) -> np.ndarray:
        norm_a, norm_b = np.sqrt(self.squares_a), np.sqrt(self.squares_b)
        with np.errstate(invalid="ignore", divide="ignore"):
            cosines = np.clip(self.dots / (norm_a * norm_b), -1.0, 1.0)
        zero_a, zero_b = norm_a == 0, norm_b == 0
        cosines = np.where(zero_a | zero_b, np.where(zero_a & zero_b, 1.0, 0.0), cosines)
        return np.where(self.finite, cosines, 0.0)


def degenerate_rows(values: np.ndarray, reference: np.ndarray | None = None) -> str | None:
    """Why the rows (vectors along the last axis) of `values` look like a broken model's output,
    or None: rows holding NaN or infinity, rows of all zeros, rows whose entries are all equal.
    With `reference` (same shape), zero and constant rows count only where the reference row is
    not so itself, so an output that is legitimately zero is not reported."""
    values = np.asarray(values, dtype=np.float64)
    rows = values.reshape(-1, values.shape[-1]) if values.ndim else values.reshape(1, 1)
    expected = None if reference is None else np.asarray(reference, dtype=np.float64).reshape(rows.shape)
    if rows.shape[0] == 0 or rows.shape[1] == 0:
        return None
    problems = []
    finite = np.isfinite(rows).all(-1)
    if (bad := int((~finite).sum())):
        problems.append(f"{bad} of {len(rows)} rows hold NaN or Inf")
    zero = finite & (rows == 0).all(-1)
    constant = finite & ~zero & (rows == rows[:, :1]).all(-1) if rows.shape[1] > 1 else np.zeros(len(rows), bool)
    if expected is not None:
        zero &= ~(expected == 0).all(-1)
        constant &= ~(expected == expected[:, :1]).all(-1)
    if (count := int(zero.sum())):
        problems.append(f"{count} of {len(rows)} rows are all zeros")
    if (count := int(constant.sum())):
        problems.append(f"{count} of {len(rows)} rows are constant (every entry equal)")
    return "; ".join(problems) or None
