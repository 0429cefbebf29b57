"""Batching requests of different lengths: sort, pad to length buckets, split by a token budget.

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library and numpy (never onnxruntime, torch or bionemo_export).

The dynamic batcher hands a model several requests at once, each a [rows, length] batch of its own
length. Running them as they come wastes compute on padding (one long row pads every short one)
or forfeits batching (one call per request). Instead every row of every request is planned:

1. rows are sorted by their real length (tokens whose attention mask is 1);
2. each row's padded length is its length rounded up to a multiple of `bucket` tokens (capped at
   `limit`, the model's maximum, and never below the row's own length); `bucket` 1 keeps every
   row at its own length, and `bucket` 0 pads every row to the longest, which is plain dynamic
   batching (Triton's own backends do that), kept as the baseline the buckets are measured against;
3. rows with the same padded length form one length bucket;
4. a bucket is split into sub-batches of at most `token_budget // padded length` rows (at least
   one), as even as possible: a sub-batch is bounded by tokens (rows x padded length), not by a
   row count, so short rows batch wide and long rows narrow;
5. with `max_rows`, a sub-batch also holds at most that many rows: a CPU's ONNX Runtime is fastest
   at a few rows per call (the real AntiBERTy on 2 cores: 2-4 rows, where the dynamic batcher
   hands over ~11 at concurrency 32), so wide batches of short rows are split to the size the host
   runs best (`bionemo-export tune` measures it).

Each sub-batch is one graph call. The attention mask covers the padding, so a row's outputs do not
depend on which rows it ran with, or how far it was padded (up to floating-point rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SubBatch:
    """One graph call: `rows` (indices into the planned rows, shortest first) padded to `length`."""

    rows: np.ndarray
    length: int

    @property
    def tokens(self) -> int:
        """Tokens the call computes, padding included."""
        return int(self.rows.size) * self.length


def padded_lengths(lengths: np.ndarray, *, bucket: int, limit: int | None = None) -> np.ndarray:
    """Each length rounded up to a multiple of `bucket` (1: unchanged; 0: the longest length), at
    most `limit` but never below the length itself."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if bucket <= 0:
        padded = np.full_like(lengths, lengths.max(initial=0))
    else:
        padded = lengths if bucket == 1 else -(-lengths // bucket) * bucket
    if limit is not None:
        padded = np.minimum(padded, limit)
    return np.maximum(padded, lengths)


def plan_sub_batches(lengths: Sequence[int] | np.ndarray, *, bucket: int, token_budget: int,
                     limit: int | None = None, max_rows: int = 0) -> list[SubBatch]:
    """Sub-batches covering every row once (see the module docstring); `token_budget` 0 or less:
    no budget (one sub-batch per length bucket); `max_rows` 0 or less: no row limit."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError("lengths must be one-dimensional")
    if lengths.size == 0:
        return []
    order = np.argsort(lengths, kind="stable")
    padded = padded_lengths(lengths[order], bucket=bucket, limit=limit)
    batches = []
    starts = np.flatnonzero(np.r_[True, padded[1:] != padded[:-1]])
    for start, end in zip(starts, np.r_[starts[1:], padded.size]):
        length = int(padded[start])
        count = end - start
        most = max(1, token_budget // length) if token_budget > 0 else count
        if max_rows > 0:
            most = min(most, max_rows)
        parts = -(-count // most)
        for rows in np.array_split(order[start:end], parts):
            batches.append(SubBatch(rows, length))
    return batches


def padding_counts(lengths: np.ndarray, batches: Sequence[SubBatch]) -> tuple[int, int]:
    """(real tokens, padding tokens) that running `batches` computes."""
    real = int(np.asarray(lengths, dtype=np.int64).sum())
    return real, sum(batch.tokens for batch in batches) - real


def stack_padded(arrays: Sequence[np.ndarray], pad_value) -> np.ndarray:
    """Concatenate [rows_i, length_i, ...] arrays along rows, padding axis 1 to the longest with
    `pad_value` (no copy beyond the one concatenation; the input itself when there is one)."""
    if len(arrays) == 1:
        return arrays[0]
    length = max(a.shape[1] for a in arrays)
    rows = sum(a.shape[0] for a in arrays)
    out = np.full((rows, length) + arrays[0].shape[2:], pad_value, dtype=arrays[0].dtype)
    start = 0
    for array in arrays:
        out[start:start + array.shape[0], :array.shape[1]] = array
        start += array.shape[0]
    return out
