"""Decoding and sampling for encoder-decoder models (MegaMolBART), numpy only.

Part of the served package, copied whole into generated Triton Python-backend model folders and imported
there as a top-level module, so it imports only the standard library and numpy. The model is
reached through `StepDecoder`, so the same algorithms drive the served graphs (ONNX Runtime or
Triton BLS) and the PyTorch reference.

Conventions (every result is a deterministic function of the inputs and the numpy Generator):
- Token ids exclude the begin token and the end token; a sequence stops at its end token or
  after `max_length` produced tokens.
- Noise: `perturb` draws `rng.standard_normal(hiddens.shape, dtype=float32)` in one call (padded
  positions too, so the draw count depends on the shape only) and adds it where the mask is True.
- Sampling draws exactly one `rng.random()` per batch row still decoding, per step, in batch order.
- Beam scores: the sum of the natural-log probabilities of the produced tokens, the end token's
  included, divided by the GNMT length penalty ((5 + L) / 6) ** length_penalty, where L counts
  those scored tokens. The default length_penalty 0 (BioNeMo's `beam_alpha`) gives the plain sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

SAMPLING_METHODS: tuple[str, ...] = (
    "greedy-perturbate",
    "topkp-perturbate",
    "beam-search-perturbate",
    "beam-search-single-sample",
    "beam-search-perturbate-sample",
)
SAMPLING_DEFAULTS = {
    "num_samples": 1,
    "scaled_radius": 1.0,
    "sampling_method": "greedy-perturbate",
    "top_k": 0,
    "top_p": 0.9,
    "temperature": 1.0,
    "beam_size": 5,
}
"""What a sampling request gets for the options it leaves out (BioNeMo's defaults)."""


class GenerationError(ValueError):
    """A bad argument to a decoding function; the message names the argument and the problem."""


class TooLargeError(GenerationError):
    """Some batch rows cannot be decoded: their hidden states (perturbed ones included) are over
    the magnitude limit or not finite, or the decoder's float32 arithmetic overflowed on them (its
    output is not finite). Raised instead of decoding garbage, which comes back as empty or random
    strings. `rows` are the caller's batch rows; `reason` says what was too large."""

    def __init__(self, rows: list[int], what: str, reason: str) -> None:
        self.rows, self.reason = rows, reason
        super().__init__(f"{what} in batch row(s) {rows}: {reason}")


class StepDecoder(Protocol):
    """One decoding step at a time over a batch of hypotheses, with an opaque cache."""

    def start(self, hiddens: np.ndarray, mask: np.ndarray) -> Any:
        """hiddens float32 [B,S,H], mask bool [B,S] -> an opaque cache (cross-attention K/V,
        empty self-attention cache)."""
        ...

    def step(self, cache: Any, tokens: np.ndarray) -> tuple[np.ndarray, Any]:
        """tokens int64 [B] (the last token of each row) -> (logits float32 [B, vocab], cache)."""
        ...

    def select(self, cache: Any, rows: np.ndarray) -> Any:
        """The cache for batch rows `rows` (int64 indices, may repeat): beam expansion and
        reordering, dropping finished rows."""
        ...


# ---------------------------------------------------------------------------------- checks
def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise GenerationError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f">= {low}"
        raise GenerationError(f"{name} must be {bounds}, got {value}")


def _check_real(name: str, value: Any, *, above: float | None = None, at_least: float | None = None,
                at_most: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise GenerationError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise GenerationError(f"{name} must be finite, got {value}")
    if above is not None and value <= above:
        raise GenerationError(f"{name} must be > {above}, got {value}")
    if at_least is not None and value < at_least:
        raise GenerationError(f"{name} must be >= {at_least}, got {value}")
    if at_most is not None and value > at_most:
        raise GenerationError(f"{name} must be <= {at_most}, got {value}")


def _check_sampling(top_k: int, top_p: float, temperature: float, label: Callable[[str], str] = str) -> None:
    _check_int(label("top_k"), top_k, 0)
    _check_real(label("top_p"), top_p, above=0.0, at_most=1.0)
    _check_real(label("temperature"), temperature, above=0.0)


LIMITS = ("max_num_samples", "max_beam_size", "max_samples_x_beams", "max_decode_tokens")
"""The bounds a served model puts on one request's work (its config's `parameters`; their
defaults live in bionemo_export/model_repository/options.py)."""


def check_decode_tokens(rows: int, length: int, limit: int, what: str) -> None:
    """GenerationError unless a decode of `rows` rows attending to `length` tokens each stays
    within `limit` tokens (max_decode_tokens): the decoder's key/value caches grow with it."""
    if rows * length > limit:
        raise GenerationError(f"{what} = {rows * length} tokens of hidden states to decode; the server's "
                              f"max_decode_tokens is {limit}")


def split_by_tokens(sizes: list[tuple[int, int]], limit: int) -> list[list[int]]:
    """Indices of `sizes` ((rows, length) per request, in order) in consecutive groups that each
    decode within `limit` tokens: rows of a group are padded to its longest length. A request
    over the limit alone gets a group of its own (callers refuse those first)."""
    groups: list[list[int]] = []
    rows = length = 0
    for index, (request_rows, request_length) in enumerate(sizes):
        if groups and (rows + request_rows) * max(length, request_length) <= limit:
            groups[-1].append(index)
            rows, length = rows + request_rows, max(length, request_length)
        else:
            groups.append([index])
            rows, length = request_rows, request_length
    return groups


def hypotheses_per_sequence(method: str, num_samples: int, beam_size: int) -> int:
    """Sequences decoded side by side for each input sequence: the work a request asks for."""
    if method == "beam-search-single-sample":
        return num_samples  # one perturbation, num_samples beams
    if method in ("beam-search-perturbate", "beam-search-perturbate-sample"):
        return num_samples * beam_size
    return num_samples


def check_sampling_arguments(method: str, num_samples: int, beam_size: int, scaled_radius: float, top_k: int,
                             top_p: float, temperature: float, *, limits: Mapping[str, int] | None = None,
                             label: Callable[[str], str] = str) -> None:
    """GenerationError unless every argument of `generate` is valid, whichever method uses it.

    `limits` (LIMITS -> int) bound num_samples, beam_size and the hypotheses decoded per sequence
    (num_samples x beam_size for the beam-search-perturbate methods); the message names the limit.
    `label(name)` is how a message names an argument (a served model names its input and row)."""
    if method not in SAMPLING_METHODS:
        raise GenerationError(f"{label('sampling_method')}: unknown sampling method {method!r}; "
                              f"valid: {', '.join(SAMPLING_METHODS)}")
    limits = limits or {}
    for name, value, limit in (("num_samples", num_samples, "max_num_samples"),
                               ("beam_size", beam_size, "max_beam_size")):
        _check_int(label(name), value, 1)
        if limit in limits and value > limits[limit]:
            raise GenerationError(f"{label(name)} must be between 1 and {limits[limit]} (the server's "
                                  f"{limit}), got {value}")
    work = hypotheses_per_sequence(method, num_samples, beam_size)
    if "max_samples_x_beams" in limits and work > limits["max_samples_x_beams"]:
        raise GenerationError(
            f"inputs num_samples x beam_size = {num_samples} x {beam_size} = {work} hypotheses per sequence with "
            f"{method}; the server's max_samples_x_beams is {limits['max_samples_x_beams']}")
    _check_real(label("scaled_radius"), scaled_radius, at_least=0.0)
    _check_sampling(top_k, top_p, temperature, label)


def _check_shapes(hiddens: np.ndarray, mask: np.ndarray) -> None:
    if not isinstance(hiddens, np.ndarray) or hiddens.ndim != 3:
        raise GenerationError(f"hiddens must be a 3-D array [batch, length, hidden], got "
                              f"{getattr(hiddens, 'shape', type(hiddens).__name__)}")
    if not np.issubdtype(hiddens.dtype, np.floating):
        raise GenerationError(f"hiddens must be floating point, got {hiddens.dtype}")
    if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_:
        raise GenerationError(f"mask must be a bool array, got {getattr(mask, 'dtype', type(mask).__name__)}")
    if mask.shape != hiddens.shape[:2]:
        raise GenerationError(f"mask shape {mask.shape} does not match hiddens [batch, length] "
                              f"{hiddens.shape[:2]}")


def validate_hiddens(hiddens: np.ndarray, mask: np.ndarray, max_magnitude: float | None = None) -> None:
    """Raise GenerationError unless hiddens [B,S,H] (float, finite, and no value's magnitude over
    `max_magnitude` when given) and mask [B,S] (bool, at least one True per row) describe a
    non-empty batch the decoder can attend to."""
    _check_shapes(hiddens, mask)
    if hiddens.shape[0] == 0 or hiddens.shape[1] == 0:
        raise GenerationError(f"hiddens must have a non-empty batch and length, got {hiddens.shape}")
    empty = np.flatnonzero(~mask.any(axis=1))
    if empty.size:
        raise GenerationError(f"mask has no True position in batch row(s) {empty.tolist()}")
    # Padded positions are checked too: NaN times a zero attention weight is still NaN.
    bad = np.flatnonzero(~np.isfinite(hiddens).all(axis=(1, 2)))
    if bad.size:
        raise GenerationError(f"hiddens contain NaN or Inf values in batch row(s) {bad.tolist()}")
    _check_magnitude(hiddens, max_magnitude, "hiddens")


def _check_magnitude(hiddens: np.ndarray, max_magnitude: float | None, what: str) -> None:
    """TooLargeError for the rows of finite `hiddens` with a value over `max_magnitude` (if any):
    encoder outputs come from a layer norm (tens at most); values far beyond make the decoder
    compute garbage or overflow."""
    if max_magnitude is None:
        return
    peak = np.abs(hiddens).max(axis=(1, 2))
    bad = peak > max_magnitude
    if bad.any():
        raise TooLargeError(np.flatnonzero(bad).tolist(), what,
                            f"values up to {float(peak.max()):.3g}; the largest magnitude a decode accepts is "
                            f"{max_magnitude:g} (max_hidden_magnitude)")


def _check_logits(logits: np.ndarray, rows: np.ndarray) -> None:
    """Logits are usable unless NaN, +Inf or all -Inf in a row (a -Inf alone is a banned token):
    what an overflow inside the decoder gives. `rows[i]` is batch entry i's original row."""
    bad = np.isnan(logits).any(axis=1) | np.isposinf(logits).any(axis=1) | np.isneginf(logits).all(axis=1)
    if bad.any():
        raise TooLargeError(sorted(set(rows[bad].tolist())), "hiddens",
                            "the decoder's output is not finite (NaN or Inf): the hidden states are too large")


# ------------------------------------------------------------------------------ primitives
def perturb(hiddens: np.ndarray, mask: np.ndarray, rng: np.random.Generator,
            scaled_radius: float, max_magnitude: float | None = None) -> np.ndarray:
    """hiddens + scaled_radius * N(0, 1) noise where mask is True, as float32; TooLargeError for
    rows that overflow float32 or exceed `max_magnitude`.

    The noise is one `rng.standard_normal(hiddens.shape, dtype=np.float32)` draw; a radius of 0
    draws nothing and returns an unchanged copy."""
    _check_real("scaled_radius", scaled_radius, at_least=0.0)
    _check_shapes(hiddens, mask)
    hiddens = np.asarray(hiddens, dtype=np.float32)
    if scaled_radius == 0:
        return hiddens.copy()
    noise = rng.standard_normal(hiddens.shape, dtype=np.float32)
    with np.errstate(over="ignore"):  # an overflow is reported below, naming the rows
        perturbed = np.where(mask[..., None], hiddens + np.float32(scaled_radius) * noise, hiddens)
    overflow = np.flatnonzero(~np.isfinite(perturbed).all(axis=(1, 2)))
    if overflow.size:
        raise TooLargeError(overflow.tolist(), "perturbed hiddens", "not finite (float32 overflow)")
    _check_magnitude(perturbed, max_magnitude, "perturbed hiddens")
    return perturbed


def _logsumexp(logits: np.ndarray) -> np.ndarray:
    """log(sum(exp(logits))) per row [N, 1] (float64; the exponentials in the logits' precision):
    log-probabilities are logits minus it."""
    peak = logits.max(axis=1, keepdims=True)
    total = np.exp(logits - peak).sum(axis=1, keepdims=True, dtype=np.float64)
    return peak.astype(np.float64) + np.log(total)


def _select(decoder: StepDecoder, cache: Any, rows: np.ndarray, batch: int) -> Any:
    """decoder.select, skipped when `rows` keeps the batch as it is."""
    if rows.size == batch and np.array_equal(rows, np.arange(batch)):
        return cache
    return decoder.select(cache, rows)


def _autoregress(decoder: StepDecoder, hiddens: np.ndarray, mask: np.ndarray,
                 pick: Callable[[np.ndarray], np.ndarray], *, begin_id: int, end_id: int,
                 max_length: int) -> list[list[int]]:
    """One token per row per step, chosen by `pick(logits [N, vocab]) -> ids [N]`, until every
    row has produced its end token or max_length tokens; finished rows leave the batch."""
    outputs: list[list[int]] = [[] for _ in range(hiddens.shape[0])]
    rows = np.arange(hiddens.shape[0])  # the original row of each decoder batch entry
    tokens = np.full(rows.size, begin_id, dtype=np.int64)
    cache = decoder.start(np.asarray(hiddens, dtype=np.float32), mask)
    for produced in range(1, max_length + 1):
        logits, cache = decoder.step(cache, tokens)
        _check_logits(logits, rows)
        tokens = np.asarray(pick(logits), dtype=np.int64)
        going = tokens != end_id
        for row, token in zip(rows[going].tolist(), tokens[going].tolist()):
            outputs[row].append(token)
        keep = np.flatnonzero(going)
        if produced == max_length or keep.size == 0:
            break
        cache = _select(decoder, cache, keep, rows.size)
        rows, tokens = rows[keep], tokens[keep]
    return outputs


def _check_decode(hiddens: np.ndarray, mask: np.ndarray, max_length: int) -> None:
    validate_hiddens(hiddens, mask)
    _check_int("max_length", max_length, 1)


# ------------------------------------------------------------------------- greedy, sampling
def greedy(decoder: StepDecoder, hiddens: np.ndarray, mask: np.ndarray, *, begin_id: int,
           end_id: int, max_length: int) -> list[list[int]]:
    """Greedy decoding of every row (argmax; ties go to the lower token id)."""
    _check_decode(hiddens, mask, max_length)
    return _autoregress(decoder, hiddens, mask, lambda logits: logits.argmax(axis=1),
                        begin_id=begin_id, end_id=end_id, max_length=max_length)


def _sample_tokens(logits: np.ndarray, rng: np.random.Generator, top_k: int, top_p: float,
                   temperature: float) -> np.ndarray:
    """One token per row from softmax(logits / temperature), restricted to the top_k most likely
    tokens (0 = all), then to the nucleus: the most likely tokens whose mass (renormalised after
    top-k) first reaches top_p. Draws `rng.random(rows)`: one uniform per row, in row order."""
    rows = np.arange(logits.shape[0])
    # A stable sort puts the lower id first among equal logits, as argmax does: top_k=1 == greedy.
    order = np.argsort(-logits, axis=1, kind="stable")
    scaled = np.take_along_axis(logits, order, axis=1).astype(np.float64) / temperature
    if 0 < top_k < scaled.shape[1]:
        scaled[:, top_k:] = -np.inf
    probs = np.exp(scaled - scaled[:, :1])
    probs /= probs.sum(axis=1, keepdims=True)
    if top_p < 1.0:
        mass_before = np.cumsum(probs, axis=1) - probs
        probs = np.where(mass_before < top_p, probs, 0.0)
    cumulative = np.cumsum(probs, axis=1)
    threshold = rng.random(rows.size) * cumulative[:, -1]
    chosen = (cumulative <= threshold[:, None]).sum(axis=1)
    # Rounding can push the threshold onto the total; the kept tokens are a prefix of `order`.
    chosen = np.minimum(chosen, (probs > 0).sum(axis=1) - 1)
    return order[rows, chosen]


def sample_top_k_top_p(decoder: StepDecoder, hiddens: np.ndarray, mask: np.ndarray,
                       rng: np.random.Generator, *, begin_id: int, end_id: int, max_length: int,
                       top_k: int = 0, top_p: float = 0.9, temperature: float = 1.0) -> list[list[int]]:
    """Ancestral sampling of every row with top-k / nucleus filtering and temperature.

    At each step, one `rng.random()` per row still decoding, in batch order (see _sample_tokens),
    so a seed reproduces the result."""
    _check_decode(hiddens, mask, max_length)
    _check_sampling(top_k, top_p, temperature)
    return _autoregress(decoder, hiddens, mask,
                        lambda logits: _sample_tokens(logits, rng, top_k, top_p, temperature),
                        begin_id=begin_id, end_id=end_id, max_length=max_length)


# ------------------------------------------------------------------------------ beam search
def _length_penalty(length: np.ndarray | int, alpha: float) -> np.ndarray:
    return ((5.0 + np.asarray(length, dtype=np.float64)) / 6.0) ** alpha


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Column indices of the k largest values of each row, best first, ties to the lower index
    (what a stable descending argsort gives). k rounds of argmax: far cheaper than sorting the
    vocabulary for a beam-sized k."""
    rest = values.copy()
    rows = np.arange(rest.shape[0])
    index = np.empty((rest.shape[0], k), dtype=np.int64)
    unsure = np.zeros(rest.shape[0], dtype=bool)  # rows out of finite values: argmax may repeat
    for place in range(k):
        index[:, place] = pick = rest.argmax(axis=1)
        unsure |= np.isneginf(rest[rows, pick])
        rest[rows, pick] = -np.inf
    if unsure.any():
        index[unsure] = np.argsort(-values[unsure], axis=1, kind="stable")[:, :k]
    return index


def _backtrack(parents: list[np.ndarray], picked: list[np.ndarray]) -> np.ndarray:
    """Token ids [B, K, steps] of the final slots (-1 where a finished slot waited)."""
    batch, beams = parents[0].shape
    slot = np.tile(np.arange(beams), (batch, 1))
    tokens = np.full((batch, beams, len(parents)), -1, dtype=np.int64)
    for step in reversed(range(len(parents))):
        tokens[:, :, step] = np.take_along_axis(picked[step], slot, axis=1)
        slot = np.take_along_axis(parents[step], slot, axis=1)
    return tokens


def beam_search(decoder: StepDecoder, hiddens: np.ndarray, mask: np.ndarray, *, begin_id: int,
                end_id: int, max_length: int, beam_size: int,
                length_penalty: float = 0.0) -> list[list[tuple[list[int], float]]]:
    """Per batch row, the `beam_size` best hypotheses as (token ids, score), best first.

    Each row keeps `beam_size` slots. At each step every unfinished slot is extended by every
    token, and the row keeps the best `beam_size` of those extensions and of its finished
    hypotheses, which stay in the beam unchanged (as in NeMo); ranking uses the normalised score
    (module docstring). A row stops when all its slots are finished (ended, or max_length tokens)
    and then leaves the decoder batch. beam_size 1 is greedy decoding. A row has fewer hypotheses
    only if fewer distinct sequences exist (a vocabulary smaller than the beam)."""
    _check_decode(hiddens, mask, max_length)
    _check_int("beam_size", beam_size, 1)
    _check_real("length_penalty", length_penalty)
    batch, beams = hiddens.shape[0], beam_size
    raw = np.full((batch, beams), -np.inf)  # sum of log-probs; -inf marks an empty slot
    raw[:, 0] = 0.0  # one start hypothesis per row: duplicates would fill the beam with copies
    length = np.zeros((batch, beams), dtype=np.int64)  # scored tokens, the end token included
    alive = np.zeros((batch, beams), dtype=bool)
    alive[:, 0] = True
    parents: list[np.ndarray] = []  # per step [B, K]: the slot each slot came from
    picked: list[np.ndarray] = []  # per step [B, K]: the token it appended (-1: none)
    tokens = np.full(batch, begin_id, dtype=np.int64)
    cache = decoder.start(np.asarray(hiddens, dtype=np.float32), mask)
    for step in range(1, max_length + 1):
        rows, slots = np.nonzero(alive)  # decoder batch order: row-major over alive slots
        logits, cache = decoder.step(cache, tokens)
        _check_logits(logits, rows)
        # Only a hypothesis' `beams` best tokens can enter the beam: rank those, not the vocabulary.
        width = min(beams, logits.shape[1])
        top = _top(logits, width)
        log_probs = np.take_along_axis(logits, top, axis=1).astype(np.float64) - _logsumexp(logits)
        active = np.unique(rows)
        at = (np.searchsorted(active, rows), slots)
        grown = np.full((active.size, beams, width), -np.inf)
        grown[at] = raw[rows, slots, None] + log_probs
        grown_tokens = np.full((active.size, beams, width), -1, dtype=np.int64)
        grown_tokens[at] = top
        grown, grown_tokens = grown.reshape(active.size, -1), grown_tokens.reshape(active.size, -1)
        waiting = np.where(alive[active], -np.inf, raw[active])  # finished: compete unchanged
        scores = np.concatenate([grown, waiting], axis=1)
        # Every extension has `step` scored tokens; a finished hypothesis keeps its own length.
        ranked = np.concatenate([grown / _length_penalty(step, length_penalty),
                                 waiting / _length_penalty(length[active], length_penalty)], axis=1)
        best = np.argsort(-ranked, axis=1, kind="stable")[:, :beams]
        extended = best < grown.shape[1]
        source = np.where(extended, best // width, best - grown.shape[1])
        token = np.where(extended, np.take_along_axis(grown_tokens, np.minimum(best, grown.shape[1] - 1),
                                                      axis=1), -1)
        new_raw = np.take_along_axis(scores, best, axis=1)

        parent_step = np.tile(np.arange(beams), (batch, 1))
        parent_step[active] = source
        picked_step = np.full((batch, beams), -1, dtype=np.int64)
        picked_step[active] = token
        parents.append(parent_step)
        picked.append(picked_step)
        raw[active] = new_raw
        length[active] = np.where(extended, step, np.take_along_axis(length[active], source, axis=1))
        alive[active] = extended & (token != end_id) & np.isfinite(new_raw)
        if step == max_length or not alive.any():
            break
        # The decoder batch entry of every (row, slot) before this step, to gather the cache.
        entry = np.full((batch, beams), -1, dtype=np.int64)
        entry[rows, slots] = np.arange(rows.size)
        next_rows, next_slots = np.nonzero(alive)
        cache = _select(decoder, cache, entry[next_rows, parent_step[next_rows, next_slots]], rows.size)
        tokens = picked_step[next_rows, next_slots]

    final = raw / _length_penalty(length, length_penalty)
    sequences = _backtrack(parents, picked)
    results: list[list[tuple[list[int], float]]] = []
    for row in range(batch):
        order = [s for s in np.argsort(-final[row], kind="stable") if np.isfinite(final[row, s])]
        results.append([([t for t in sequences[row, s].tolist() if t >= 0 and t != end_id],
                          float(final[row, s])) for s in order])
    return results


# ---------------------------------------------------------------------------------- methods
def generate(decoder: StepDecoder, hiddens: np.ndarray, mask: np.ndarray, *, method: str,
             num_samples: int, scaled_radius: float, rng: np.random.Generator, begin_id: int,
             end_id: int, max_length: int, top_k: int = 0, top_p: float = 0.9,
             temperature: float = 1.0, beam_size: int = 5,
             max_magnitude: float | None = None) -> list[list[list[int]]]:
    """Token ids per batch row, per output, for one of SAMPLING_METHODS (n = num_samples):

    - greedy-perturbate: n perturbations, greedy decoding of each -> n outputs;
    - topkp-perturbate: n perturbations, top-k/top-p sampling of each -> n outputs;
    - beam-search-perturbate: n perturbations, beam search of each, the best beam of each
      -> n outputs;
    - beam-search-single-sample: one perturbation, beam search with n beams (beam_size is
      ignored), every beam, best first -> n outputs;
    - beam-search-perturbate-sample: n perturbations, beam search of each, every beam kept, best
      first -> n * beam_size outputs (perturbation-major).
    These follow BioNeMo 1.x's MegaMolBART sampling, so existing clients get the shapes they expect.

    The perturbations decode as one batch of n * B rows, sample-major (sample s of row b is
    batch entry s * B + b), perturbed by one `perturb` call: the noise of sample 0 of every row
    is drawn first, then sample 1, and so on; sampling then draws as sample_top_k_top_p does.
    Every argument is checked, whichever method uses it; perturbed rows over `max_magnitude` (or
    whose decoder output overflows) raise TooLargeError naming their batch entries."""
    check_sampling_arguments(method, num_samples, beam_size, scaled_radius, top_k, top_p, temperature)
    _check_decode(hiddens, mask, max_length)

    batch = hiddens.shape[0]
    copies = 1 if method == "beam-search-single-sample" else num_samples
    tiled_mask = np.tile(mask, (copies, 1))
    perturbed = perturb(np.tile(hiddens, (copies, 1, 1)), tiled_mask, rng, scaled_radius, max_magnitude)
    ids = dict(begin_id=begin_id, end_id=end_id, max_length=max_length)
    if method == "greedy-perturbate":
        outputs = [[seq] for seq in greedy(decoder, perturbed, tiled_mask, **ids)]
    elif method == "topkp-perturbate":
        outputs = [[seq] for seq in sample_top_k_top_p(decoder, perturbed, tiled_mask, rng, top_k=top_k,
                                                       top_p=top_p, temperature=temperature, **ids)]
    else:
        if method == "beam-search-single-sample":
            beam_size = num_samples
        kept = 1 if method == "beam-search-perturbate" else beam_size
        beams = beam_search(decoder, perturbed, tiled_mask, beam_size=beam_size, **ids)
        outputs = [[seq for seq, _ in hypotheses[:kept]] for hypotheses in beams]
    return [[seq for copy in range(copies) for seq in outputs[copy * batch + row]]
            for row in range(batch)]
