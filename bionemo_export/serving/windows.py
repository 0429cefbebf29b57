"""Proteins longer than the model's window: overlapping windows, run separately, merged into one answer.

Part of the served package, copied whole into generated Triton Python-backend model folders and imported there
as `import windows`, so it imports only the standard library, numpy and its sibling module
batching.py (never torch, transformers, onnxruntime or bionemo_export). The served model stays
wiring:

    layout = windows.layout_windows([len(s) for s in sequences], window=W, overlap=OVERLAP,
                                    max_residues=MAX_RESIDUES)     # WindowError: over the limit
    texts = layout.texts(sequences)                      # one residue string per encoder row
    rows = [None] * layout.rows                          # per row: [tokens, D], BOS + residues + EOS
    for batch in layout.sub_batches(bucket=B, token_budget=BUDGET, limit=W + 2):
        ...run texts[batch.rows] (each tokenized as usual: BOS + window + EOS), store each row's output...
    for i in range(len(sequences)):
        hiddens = windows.merge_rows(layout.outputs_of(i, rows), layout.spans[i], has_bos=True, has_eos=True)
        mask = windows.residue_mask(len(sequences[i]), has_bos=True, has_eos=True)
        embeddings = windows.mean_embedding(hiddens, mask)

Planning (`plan_windows`). A sequence of n residues, a model window of W residues (its maximum
residues: 1022 for ESM-2, whose 1024 tokens include BOS and EOS), and an overlap (residues that
consecutive windows share at least; default W // 4, `default_overlap`; 0 <= overlap < W):
- n <= W: one window (0, n). That is the single pass: tokens, outputs and merge are exactly what
  the model gives without windows.
- n > W: k = 1 + ceil((n - W) / (W - overlap)) windows, the fewest of W residues whose consecutive
  overlaps are all at least `overlap`. Every window holds exactly W residues (the most context the
  model takes; no short last window), and the starts are spread evenly over 0..n - W:
  start_i = floor(i * (n - W) / (k - 1)), end_i = start_i + W, so the first starts at 0, the last
  ends at n, and consecutive starts differ by floor or ceil of (n - W) / (k - 1) <= W - overlap:
  the actual overlaps differ from each other by at most one residue and are never below `overlap`.
- n > `max_residues` (the stated maximum, e.g. 10,000) is a WindowError naming n and the limit: a
  request's work is bounded by k windows of W + specials tokens each.
Each window is tokenized as the model expects, on its own: BOS + the window's residues + EOS
(`window_texts` gives the residue substrings; the tokenizer adds the specials).

Merge rule (`merge_rows`, `owners`). The windows' per-residue rows (hiddens [*, H], log-probs
[*, A]) are merged into one array in the single-pass layout. Each residue's row is COPIED from
exactly one window, the window in which the residue has the most context on its poorer side:
    score(p, window (s, e)) = min(left, right),  left = p - s, right = e - 1 - p,
where a side at the sequence's own end (s == 0 for left, e == n for right) counts as unlimited
(nothing was cut away there); the highest score wins, ties to the earlier window. Where two
consecutive windows share residues a..b-1 (L = b - a of them) and L <= W / 2 (or they are the
only two windows), this cuts the overlap at its middle: the earlier window keeps residues
a..a + ceil(L / 2) - 1, the later one the other floor(L / 2). Either way every residue is read
from a window that gives it at least floor(overlap / 2) residues of context on each side where a
window was cut (near the sequence's ends: all the context there is); with larger overlaps the
same score picks the window in which the residue is most central.
The merged BOS row is the first window's BOS row and the merged EOS row the last window's EOS row
(models without BOS/EOS rows: `has_bos` / `has_eos` False, and none in the result), so the
result is laid out as a single pass would be: BOS + n residue rows + EOS, and `residue_mask` is
True exactly on the n residue rows. Embeddings are the mean of the merged residue rows
(`mean_embedding`), the model's own pooling (mean of hiddens over the residue mask) applied to
the merged hiddens, not an average of the windows' embeddings.

Why cut rather than cross-fade (a weighted blend over the overlap): a residue's context is
poorest at the window edge that cut the sequence, and a cross-fade still gives rows from there
some weight; cutting reads every residue where its context is best and never uses a row with
fewer than floor(overlap / 2) residues between it and a cut edge. Every merged row is one the model actually produced
for that residue (a blend of two hidden vectors is a vector neither window produced, and a blend
of log-probabilities is no longer a normalized distribution), and the rule is exact and cheap to
reproduce: a copy per residue, no weights. Its cost is a step at each cut point, where the source
window changes; the benchmark in tests/unit/test_windows.py measures how far the merged rows are from
a single pass where one is possible.

Batching (`layout_windows`, `WindowLayout`): the windows of several sequences are rows for the
encoder, planned into sub-batches by batching.plan_sub_batches under the token budget (rows x
padded length <= budget), and mapped back to (sequence, window).

Errors: WindowError (a ValueError) is the request's fault (a sequence over the limit): the served
model answers INVALID_ARGUMENT with its message. A plain ValueError (bad window, overlap or limit
settings, outputs of the wrong shape) is the caller's or the build's bug.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from .batching import SubBatch, plan_sub_batches

_Row = TypeVar("_Row")
"""What a batch holds per window (an output array, in the served models)."""

Span = tuple[int, int]
"""A window's residues as a half-open range (start, end) of 0-based residue positions."""


class WindowError(ValueError):
    """A request the windows cannot serve (a sequence over the stated maximum); the message names
    the length and the limit."""


def default_overlap(window: int) -> int:
    """The overlap used when none is given: a quarter of the window (255 residues for ESM-2's 1022),
    so every residue keeps at least an eighth of a window of context on each cut side."""
    return window // 4


def check_settings(window: int, overlap: int, max_residues: int) -> None:
    """ValueError naming the setting unless window >= 1, 0 <= overlap < window, max_residues >= 1."""
    for name, value in (("window", window), ("overlap", overlap), ("max_residues", max_residues)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if window < 1:
        raise ValueError(f"window {window} must be at least 1 residue")
    if not 0 <= overlap < window:
        raise ValueError(f"overlap {overlap} must be at least 0 and below the window of {window} residues")
    if max_residues < 1:
        raise ValueError(f"max_residues {max_residues} must be at least 1 residue")


def window_count(length: int, window: int, overlap: int) -> int:
    """The fewest windows of `window` residues covering `length` residues with consecutive
    overlaps of at least `overlap` (1 when the sequence fits)."""
    if length <= window:
        return 1
    return 1 + -(-(length - window) // (window - overlap))


def plan_windows(length: int, window: int, *, overlap: int | None = None, max_residues: int) -> list[Span]:
    """The windows (start, end) covering residues 0..length (see the module docstring): one
    (0, length) when it fits, else windows of exactly `window` residues spread evenly.
    WindowError when `length` is over `max_residues`; ValueError for bad settings or length < 1."""
    overlap = default_overlap(window) if overlap is None else overlap
    check_settings(window, overlap, max_residues)
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
        raise ValueError(f"length {length!r} must be a positive number of residues")
    if length > max_residues:
        raise WindowError(f"sequence of {length} residues is longer than the maximum of {max_residues} "
                          "residues for windowed inputs")
    count = window_count(length, window, overlap)
    if count == 1:
        return [(0, int(length))]
    # integer arithmetic: floor(i * (n - W) / (k - 1)) exactly, first 0, last n - W
    starts = [i * (length - window) // (count - 1) for i in range(count)]
    return [(int(start), int(start) + window) for start in starts]


def window_texts(sequence: str, spans: Sequence[Span]) -> list[str]:
    """The residue substrings of `sequence` the windows cover, each tokenized on its own."""
    return [sequence[start:end] for start, end in spans]


def owners(length: int, spans: Sequence[Span]) -> np.ndarray:
    """[length] int: the index of the window each residue's row is taken from (the merge rule in
    the module docstring). ValueError unless the spans cover 0..length in order."""
    check_spans(length, spans)
    unlimited = length + 1  # more than any real distance: a side at the sequence's end was not cut
    best = np.full(length, -1, dtype=np.int64)
    owner = np.zeros(length, dtype=np.int64)
    for index, (start, end) in enumerate(spans):
        positions = np.arange(start, end)
        left = positions - start if start > 0 else np.full(positions.size, unlimited)
        right = end - 1 - positions if end < length else np.full(positions.size, unlimited)
        score = np.minimum(left, right)
        # strictly greater: on a tie the earlier window, already recorded, keeps the residue
        better = score > best[start:end]
        best[start:end][better] = score[better]
        owner[start:end][better] = index
    return owner


def check_spans(length: int, spans: Sequence[Span]) -> None:
    """ValueError naming the problem unless `spans` are non-empty windows inside 0..length with
    increasing starts, the first at 0, the last ending at length, and no residue uncovered."""
    if not spans:
        raise ValueError("no windows given")
    covered = 0
    for index, (start, end) in enumerate(spans):
        if not 0 <= start < end <= length:
            raise ValueError(f"window {index} ({start}, {end}) is not a non-empty range inside 0..{length}")
        if start > covered:
            raise ValueError(f"window {index} ({start}, {end}) leaves residues {covered}..{start - 1} uncovered")
        if index and start <= spans[index - 1][0]:
            raise ValueError(f"window {index} ({start}, {end}) does not start after window {index - 1}")
        covered = max(covered, end)
    if spans[0][0] != 0 or covered != length:
        raise ValueError(f"windows {list(spans)} do not cover residues 0..{length}")


def merge_rows(outputs: Sequence[np.ndarray] | np.ndarray, spans: Sequence[Span], *, has_bos: bool,
               has_eos: bool) -> np.ndarray:
    """The windows' outputs merged into the single-pass layout [bos + n + eos, D] (n = the last
    span's end): residue rows by the merge rule, BOS from the first window, EOS from the last.

    outputs[i] is window i's [tokens, D] rows as the encoder returns them: BOS (when `has_bos`),
    its residues, EOS (when `has_eos`), then any padding (ignored). A [windows, tokens, D] array
    works as well. ValueError when the counts or shapes do not fit the spans."""
    if len(outputs) != len(spans):
        raise ValueError(f"{len(outputs)} window outputs for {len(spans)} windows")
    length = int(spans[-1][1]) if spans else 0
    owner = owners(length, spans)
    bos, eos = int(has_bos), int(has_eos)
    arrays = [np.asarray(output) for output in outputs]
    trailing = arrays[0].shape[1:]
    for index, (array, (start, end)) in enumerate(zip(arrays, spans)):
        if array.ndim < 1 or array.shape[1:] != trailing or array.shape[0] < bos + (end - start) + eos:
            raise ValueError(f"window {index} ({start}, {end}) output has shape {list(array.shape)}; expected "
                             f"[at least {bos + (end - start) + eos}, ...] rows like window 0's {list(trailing)}")
    merged = np.empty((bos + length + eos,) + trailing, dtype=np.result_type(*arrays))
    for index, (array, (start, end)) in enumerate(zip(arrays, spans)):
        mine = np.flatnonzero(owner[start:end] == index)  # offsets inside the window
        merged[bos + start + mine] = array[bos + mine]
    if has_bos:
        merged[0] = arrays[0][0]
    if has_eos:
        last_start, last_end = spans[-1]
        merged[-1] = arrays[-1][bos + last_end - last_start]
    return merged


def residue_mask(length: int, *, has_bos: bool, has_eos: bool) -> np.ndarray:
    """[bos + length + eos] bool: True exactly on the residue rows of a merged array."""
    return np.r_[np.zeros(int(has_bos), bool), np.ones(length, bool), np.zeros(int(has_eos), bool)]


def mean_embedding(merged: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The embedding [D]: the mean of the merged rows where `mask` is True (the model's pooling)."""
    if merged.shape[:1] != mask.shape:
        raise ValueError(f"merged rows of shape {list(merged.shape)} do not match a mask of shape {list(mask.shape)}")
    return merged[mask].mean(axis=0, dtype=np.float64).astype(merged.dtype, copy=False)


@dataclass(frozen=True, eq=False)  # eq=False: numpy fields have no single truth value to compare
class WindowLayout:
    """All windows of several sequences as encoder rows: row r is window `window[r]` of sequence
    `sequence[r]`, residues `start[r]`..`end[r]` of it, `tokens[r]` tokens with its specials.
    Rows are in sequence order, each sequence's windows in order."""

    spans: list[list[Span]]  # per sequence, its windows
    sequence: np.ndarray
    window: np.ndarray
    start: np.ndarray
    end: np.ndarray
    tokens: np.ndarray
    first_row: np.ndarray  # [sequences + 1]: sequence i's rows are first_row[i]..first_row[i + 1]

    @property
    def rows(self) -> int:
        """Encoder rows (windows) in all."""
        return int(self.sequence.size)

    def texts(self, sequences: Sequence[str], width: int = 1) -> list[str]:
        """Each row's residue string, the substring of its sequence the tokenizer encodes; `width`
        characters spell a residue (2: SaProt's structure-aware sequences, residue + 3Di letter)."""
        if len(sequences) != len(self.spans):
            raise ValueError(f"{len(sequences)} sequences for a layout of {len(self.spans)}")
        return [sequences[int(s)][width * a:width * b]
                for s, a, b in zip(self.sequence.tolist(), self.start.tolist(), self.end.tolist())]

    def sub_batches(self, *, bucket: int, token_budget: int, limit: int | None = None) -> list[SubBatch]:
        """The rows planned into graph calls by batching.plan_sub_batches: each call at most
        `token_budget` tokens, rows x padded length (a single row over it runs alone)."""
        return plan_sub_batches(self.tokens, bucket=bucket, token_budget=token_budget, limit=limit)

    def rows_of(self, sequence: int) -> range:
        """Sequence `sequence`'s rows, its windows in order."""
        return range(int(self.first_row[sequence]), int(self.first_row[sequence + 1]))

    def outputs_of(self, sequence: int, outputs: Sequence[_Row]) -> list[_Row]:
        """From per-row outputs (indexed by row), sequence `sequence`'s windows' outputs in order,
        ready for merge_rows with its spans."""
        return [outputs[row] for row in self.rows_of(sequence)]


def layout_windows(lengths: Sequence[int], *, window: int, overlap: int | None = None, max_residues: int,
                   specials: int = 2) -> WindowLayout:
    """The windows of sequences of `lengths` residues as encoder rows; `specials` tokens added to
    each window by the tokenizer (2: BOS and EOS). WindowError naming the sequence (its index),
    its length and the limit when one is over `max_residues`."""
    spans = []
    for index, length in enumerate(lengths):
        try:
            spans.append(plan_windows(int(length), window, overlap=overlap, max_residues=max_residues))
        except WindowError as err:
            raise WindowError(f"sequences[{index}]: {err}") from None
    counts = np.array([len(s) for s in spans], dtype=np.int64)
    flat = [span for per_sequence in spans for span in per_sequence]
    start = np.array([a for a, _ in flat], dtype=np.int64)
    end = np.array([b for _, b in flat], dtype=np.int64)
    first_row = np.r_[0, np.cumsum(counts)].astype(np.int64)
    return WindowLayout(
        spans=spans,
        sequence=np.repeat(np.arange(len(spans), dtype=np.int64), counts),
        window=np.arange(first_row[-1], dtype=np.int64) - np.repeat(first_row[:-1], counts),
        start=start, end=end, tokens=end - start + specials, first_row=first_row)
