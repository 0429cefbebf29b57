"""Decoding and sampling (bionemo_export.serving.search) against toy numpy decoders.

The toy model's next-token logits depend on the last two tokens and on the masked mean of the
hidden states (so perturbation matters). Its cache carries each entry's original row and token
history: a wrong `select` changes the logits, and the per-step row log shows which rows were
decoded. Every expectation is computed independently of the cache, by brute force.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from bionemo_export.serving.search import (
    GenerationError,
    TooLargeError,
    beam_search,
    check_decode_tokens,
    check_sampling_arguments,
    generate,
    greedy,
    perturb,
    sample_top_k_top_p,
    split_by_tokens,
    validate_hiddens,
)

BEGIN, END = 0, 1


class ToyDecoder:
    """logits(prefix) = A[last] + C[second last (begin on the first step)] + pooled(hiddens) @ P,
    random; or, when `A` is given, the Markov table A alone (C = P = 0)."""

    def __init__(self, vocab: int = 6, hidden: int = 4, seed: int = 0, *, end_bias: float = 0.0,
                 A: np.ndarray | None = None) -> None:
        rng = np.random.default_rng(seed)
        self.A = rng.normal(size=(vocab, vocab)) * 2.0 if A is None else A.copy()
        self.A[:, END] += end_bias
        self.C = np.zeros((vocab, vocab)) if A is not None else rng.normal(size=(vocab, vocab))
        self.P = np.zeros((hidden, vocab)) if A is not None else rng.normal(size=(hidden, vocab))
        self.started: list[np.ndarray] = []  # hiddens given to each start()
        self.step_rows: list[list[int]] = []  # original rows of each step's batch

    def start(self, hiddens: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        assert hiddens.dtype == np.float32 and mask.dtype == np.bool_
        self.started.append(hiddens.copy())
        rows = np.arange(hiddens.shape[0])
        return {"rows": rows, "bias": pooled(hiddens, mask) @ self.P,
                "history": np.zeros((rows.size, 0), dtype=np.int64)}

    def step(self, cache: dict[str, np.ndarray], tokens: np.ndarray):
        assert tokens.dtype == np.int64 and tokens.shape == cache["rows"].shape
        history = np.concatenate([cache["history"], tokens[:, None]], axis=1)
        previous = history[:, -2] if history.shape[1] > 1 else history[:, -1]
        logits = self.A[history[:, -1]] + self.C[previous] + cache["bias"]
        self.step_rows.append(cache["rows"].tolist())
        return logits.astype(np.float32), {**cache, "history": history}

    def select(self, cache: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
        assert rows.dtype == np.int64
        return {key: value[rows] for key, value in cache.items()}

    def reference_logits(self, hiddens: np.ndarray, mask: np.ndarray, prefix: list[int]) -> np.ndarray:
        """The logits after `prefix` (begin token first) for one row, without any cache."""
        previous = prefix[-2] if len(prefix) > 1 else prefix[-1]
        bias = pooled(hiddens[None].astype(np.float32), mask[None])[0] @ self.P
        return (self.A[prefix[-1]] + self.C[previous] + bias).astype(np.float32)


def pooled(hiddens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return (hiddens * mask[..., None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)


def inputs(batch: int = 5, length: int = 7, hidden: int = 4, seed: int = 1):
    rng = np.random.default_rng(seed)
    hiddens = rng.normal(size=(batch, length, hidden)).astype(np.float32)
    lengths = rng.integers(1, length + 1, size=batch)
    mask = np.arange(length)[None, :] < lengths[:, None]
    return hiddens, mask


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def brute_greedy(model: ToyDecoder, hiddens, mask, max_length: int) -> list[list[int]]:
    outputs = []
    for h, m in zip(hiddens, mask):
        prefix = [BEGIN]
        while len(prefix) - 1 < max_length:
            token = int(np.argmax(model.reference_logits(h, m, prefix)))
            if token == END:
                break
            prefix.append(token)
        outputs.append(prefix[1:])
    return outputs


def brute_ranking(model: ToyDecoder, h, m, max_length: int, alpha: float):
    """Every sequence the decoder can produce for one row, scored (float64 throughout, where the
    search exponentiates float32 logits in float32: scores agree to ~1e-7), best first."""
    vocab = model.A.shape[0]
    tokens = [t for t in range(vocab) if t != END]
    ranked = []
    for size in range(max_length + 1):
        for body in itertools.product(tokens, repeat=size):
            scored = list(body) + ([END] if size < max_length else [])
            prefix, total = [BEGIN], 0.0
            for token in scored:
                total += log_softmax(model.reference_logits(h, m, prefix))[token]
                prefix.append(token)
            ranked.append((list(body), total / ((5 + len(scored)) / 6) ** alpha))
    return sorted(ranked, key=lambda item: -item[1])


KW = dict(begin_id=BEGIN, end_id=END)


# ------------------------------------------------------------------------------------ greedy
@pytest.mark.parametrize("seed", range(4))
def test_greedy_matches_brute_force_and_drops_finished_rows(seed):
    model = ToyDecoder(seed=seed, end_bias=1.0)
    hiddens, mask = inputs(batch=8, seed=seed)
    max_length = 6
    got = greedy(model, hiddens, mask, max_length=max_length, **KW)
    assert got == brute_greedy(model, hiddens, mask, max_length)
    assert all(END not in seq and len(seq) <= max_length for seq in got)
    # Row r is decoded at steps 1..n_r: through its end token, or max_length steps.
    steps = [len(seq) + 1 if len(seq) < max_length else max_length for seq in got]
    assert len({len(seq) for seq in got}) > 1, "the toy should stop rows at different steps"
    assert model.step_rows == [[r for r in range(8) if steps[r] >= t] for t in range(1, max(steps) + 1)]


def test_greedy_stops_at_max_length():
    model = ToyDecoder(end_bias=-50.0)
    hiddens, mask = inputs()
    got = greedy(model, hiddens, mask, max_length=3, **KW)
    assert [len(seq) for seq in got] == [3] * 5
    assert len(model.step_rows) == 3


# ---------------------------------------------------------------------------------- sampling
def fixed_decoder(probs: list[float]) -> ToyDecoder:
    """The same next-token distribution after every prefix."""
    return ToyDecoder(vocab=len(probs), A=np.tile(np.log(probs), (len(probs), 1)))


def token_counts(probs, n: int, **options) -> np.ndarray:
    hiddens, mask = np.zeros((n, 1, 4), np.float32), np.ones((n, 1), bool)
    got = sample_top_k_top_p(fixed_decoder(probs), hiddens, mask, np.random.default_rng(0), max_length=1,
                             **KW, **options)
    return np.bincount([seq[0] for seq in got], minlength=len(probs)) / n


PROBS = [0.02, 1e-9, 0.5, 0.3, 0.18]  # sorted: 2, 3, 4, 0, end


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    counts = token_counts(PROBS, 4000, top_p=0.75)  # 0.5 < 0.75 <= 0.8: tokens 2 and 3
    assert counts[[0, 1, 4]].sum() == 0
    assert counts[2] == pytest.approx(0.5 / 0.8, abs=0.03)


def test_top_k_then_top_p_on_the_renormalised_distribution():
    assert token_counts(PROBS, 2000, top_k=3, top_p=1.0)[[0, 1]].sum() == 0
    # top-2 renormalised is (0.625, 0.375): a top_p of 0.6 keeps token 2 only.
    assert token_counts(PROBS, 500, top_k=2, top_p=0.6)[2] == 1.0


@pytest.mark.parametrize("options", [dict(top_k=1), dict(top_p=1e-9), dict(temperature=1e-4, top_p=1.0)])
def test_degenerate_sampling_is_greedy(options):
    model = ToyDecoder(seed=3, end_bias=1.0)
    hiddens, mask = inputs(batch=8)
    got = sample_top_k_top_p(model, hiddens, mask, np.random.default_rng(5), max_length=6, **KW, **options)
    assert got == brute_greedy(model, hiddens, mask, 6)


def test_sampling_is_reproducible_for_a_seed():
    hiddens, mask = inputs(batch=8)

    def run(seed):
        return sample_top_k_top_p(ToyDecoder(seed=2), hiddens, mask, np.random.default_rng(seed),
                                  max_length=8, temperature=2.0, top_p=0.95, **KW)

    assert run(11) == run(11)
    assert run(11) != run(12)


# ------------------------------------------------------------------------------- beam search
@pytest.mark.parametrize("seed", range(3))
def test_beam_size_one_is_greedy(seed):
    hiddens, mask = inputs(batch=8, seed=seed)
    by_greedy, by_beam = ToyDecoder(seed=seed, end_bias=1.0), ToyDecoder(seed=seed, end_bias=1.0)
    expected = greedy(by_greedy, hiddens, mask, max_length=6, **KW)
    got = beam_search(by_beam, hiddens, mask, max_length=6, beam_size=1, **KW)
    assert [[seq for seq, _ in row] for row in got] == [[seq] for seq in expected]
    assert by_beam.step_rows == by_greedy.step_rows  # finished rows leave the batch as in greedy


def test_beam_size_one_is_greedy_with_tied_logits():
    model = ToyDecoder(vocab=6, A=np.round(np.random.default_rng(0).normal(size=(6, 6))))
    hiddens, mask = inputs(batch=4)
    expected = greedy(model, hiddens, mask, max_length=8, **KW)
    got = beam_search(model, hiddens, mask, max_length=8, beam_size=1, **KW)
    assert [[seq for seq, _ in row] for row in got] == [[seq] for seq in expected]


@pytest.mark.parametrize("alpha", [0.0, 1.0])
@pytest.mark.parametrize("seed", range(3))
def test_exhaustive_beam_ranks_every_sequence_like_brute_force(seed, alpha):
    model = ToyDecoder(vocab=4, seed=seed)
    hiddens, mask = inputs(batch=2, seed=seed)
    max_length = 4
    total = 1 + 3 + 9 + 27 + 81  # ended after 0..3 tokens, or 4 tokens without an end
    got = beam_search(model, hiddens, mask, max_length=max_length, beam_size=total, length_penalty=alpha,
                      **KW)
    for row, hypotheses in enumerate(got):
        expected = brute_ranking(model, hiddens[row], mask[row], max_length, alpha)
        # Orders differ only among exact ties (sequences made of the same transitions).
        np.testing.assert_allclose([s for _, s in hypotheses], [s for _, s in expected], rtol=1e-6)
        score_of = {tuple(seq): score for seq, score in expected}
        assert len({tuple(seq) for seq, _ in hypotheses}) == len(score_of)
        np.testing.assert_allclose([s for _, s in hypotheses], [score_of[tuple(q)] for q, _ in hypotheses],
                                   rtol=1e-6)


def trap() -> ToyDecoder:
    """From begin: a 0.6, b 0.4 (nothing else). After a: end 0.3, a 0.36, b 0.34. After b: end 0.9."""
    a, b = 2, 3
    table = np.zeros((4, 4))
    table[BEGIN, [a, b]] = 0.6, 0.4
    table[a, [END, a, b]] = 0.3, 0.36, 0.34
    table[b, [END, a, b]] = 0.9, 0.05, 0.05
    table[END] = table[b]
    with np.errstate(divide="ignore"):  # impossible tokens get -inf logits
        return ToyDecoder(vocab=4, A=np.log(table))


def test_small_beam_escapes_the_greedy_trap():
    a, b = 2, 3
    hiddens, mask = np.zeros((1, 1, 4), np.float32), np.ones((1, 1), bool)
    assert greedy(trap(), hiddens, mask, max_length=4, **KW) == [[a, a, a, a]]
    best, second = beam_search(trap(), hiddens, mask, max_length=4, beam_size=2, **KW)[0]
    assert best[0] == [b] and best[1] == pytest.approx(np.log(0.4 * 0.9))
    assert second[0] == [a, a, a, a] and second[1] == pytest.approx(np.log(0.6 * 0.36**3))
    # Three slots but two possible first tokens: the third slot stays empty until step 2.
    hypotheses = beam_search(trap(), hiddens, mask, max_length=4, beam_size=3, **KW)[0]
    assert [seq for seq, _ in hypotheses] == [[b], [a, b], [a, a, a, a]]
    assert [score for _, score in hypotheses] == pytest.approx(np.log([0.36, 0.6 * 0.34 * 0.9, 0.6 * 0.36**3]))


def test_beam_returns_beam_size_hypotheses_best_first():
    model = ToyDecoder(vocab=12, seed=4, end_bias=1.0)
    hiddens, mask = inputs(batch=6)
    got = beam_search(model, hiddens, mask, max_length=10, beam_size=4, **KW)
    for hypotheses in got:
        scores = [score for _, score in hypotheses]
        assert len(hypotheses) == 4 and scores == sorted(scores, reverse=True)
        assert len({tuple(seq) for seq, _ in hypotheses}) == 4
        assert all(END not in seq and len(seq) <= 10 for seq, _ in hypotheses)
    assert len(model.step_rows[-1]) < 6 * 4  # finished hypotheses and rows are no longer decoded


# ---------------------------------------------------------------------------------- perturb
def test_perturb_adds_scaled_noise_on_masked_positions_only():
    hiddens, mask = inputs()
    got = perturb(hiddens, mask, np.random.default_rng(7), 0.5)
    noise = np.random.default_rng(7).standard_normal(hiddens.shape, dtype=np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got[~mask], hiddens[~mask])
    np.testing.assert_array_equal(got[mask], hiddens[mask] + np.float32(0.5) * noise[mask])


def test_perturb_with_radius_zero_draws_nothing():
    hiddens, mask = inputs()
    rng = np.random.default_rng(7)
    state = rng.bit_generator.state
    np.testing.assert_array_equal(perturb(hiddens, mask, rng, 0.0), hiddens)
    assert rng.bit_generator.state == state


# --------------------------------------------------------------------------------- generate
def run_generate(method: str, *, seed: int = 0, model: ToyDecoder | None = None, **options):
    hiddens, mask = inputs(batch=3)
    options = {"num_samples": 4, "scaled_radius": 1.0, "max_length": 6, "beam_size": 5, **options}
    return generate(model or ToyDecoder(), hiddens, mask, method=method, rng=np.random.default_rng(seed),
                    **KW, **options)


@pytest.mark.parametrize("method, per_row", [
    ("greedy-perturbate", 4), ("topkp-perturbate", 4), ("beam-search-perturbate", 4),
    ("beam-search-single-sample", 4), ("beam-search-perturbate-sample", 20),
])
def test_generate_counts_and_one_batched_decode(method, per_row):
    model = ToyDecoder()
    got = run_generate(method, model=model)
    assert len(got) == 3 and all(len(outputs) == per_row for outputs in got)
    copies = 1 if method == "beam-search-single-sample" else 4
    assert [h.shape[0] for h in model.started] == [3 * copies]


def test_generate_noise_is_drawn_sample_major():
    model = ToyDecoder()
    run_generate("greedy-perturbate", model=model, seed=9)
    hiddens, mask = inputs(batch=3)
    rng = np.random.default_rng(9)
    expected = np.concatenate([perturb(hiddens, mask, rng, 1.0) for _ in range(4)])
    np.testing.assert_array_equal(model.started[0], expected)


def test_generate_outputs_follow_their_perturbations():
    hiddens, mask = inputs(batch=3)
    perturbed = perturb(hiddens, mask, np.random.default_rng(0), 1.0)
    rng = np.random.default_rng(0)
    tiled = np.concatenate([perturb(hiddens, mask, rng, 1.0) for _ in range(4)])
    tiled_mask = np.tile(mask, (4, 1))

    def per_row(flat):  # sample-major batch -> rows x samples
        return [[flat[s * 3 + r] for s in range(4)] for r in range(3)]

    greedy_out = per_row(greedy(ToyDecoder(), tiled, tiled_mask, max_length=6, **KW))
    assert run_generate("greedy-perturbate") == greedy_out
    beams = per_row(beam_search(ToyDecoder(), tiled, tiled_mask, max_length=6, beam_size=5, **KW))
    assert run_generate("beam-search-perturbate") == [[b[0][0] for b in row] for row in beams]
    assert run_generate("beam-search-perturbate-sample") == [[s for b in row for s, _ in b] for row in beams]
    # single-sample: one perturbation, num_samples beams (beam_size is ignored), every beam.
    single = beam_search(ToyDecoder(), perturbed, mask, max_length=6, beam_size=4, **KW)
    assert run_generate("beam-search-single-sample", beam_size=2) == [[s for s, _ in row] for row in single]


def test_generate_without_noise_is_greedy():
    hiddens, mask = inputs(batch=3)
    expected = greedy(ToyDecoder(), hiddens, mask, max_length=6, **KW)
    assert run_generate("greedy-perturbate", scaled_radius=0.0) == [[seq] * 4 for seq in expected]


@pytest.mark.parametrize("method", ["greedy-perturbate", "topkp-perturbate"])
def test_generate_is_reproducible_for_a_seed(method):
    assert run_generate(method, seed=3) == run_generate(method, seed=3)
    assert run_generate(method, seed=3) != run_generate(method, seed=4)


# ----------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("options, names", [
    (dict(method="nucleus"), "'nucleus'; valid: greedy-perturbate, topkp-perturbate"),
    (dict(num_samples=0), "num_samples"),
    (dict(num_samples=2.0), "num_samples"),
    (dict(num_samples=True), "num_samples"),
    (dict(beam_size=0), "beam_size"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(scaled_radius=-0.1), "scaled_radius"),
    (dict(scaled_radius=float("nan")), "scaled_radius"),
    (dict(scaled_radius=float("inf")), "scaled_radius"),
    (dict(max_length=0), "max_length"),
])
def test_generate_rejects_bad_arguments(options, names):
    options = {"method": "greedy-perturbate", **options}
    with pytest.raises(GenerationError) as error:
        run_generate(**options)
    assert names in str(error.value)


LIMITS = {"max_num_samples": 32, "max_beam_size": 16, "max_samples_x_beams": 64}


@pytest.mark.parametrize("method, num_samples, beam_size, message", [
    ("greedy-perturbate", 33, 5, "num_samples must be between 1 and 32 (the server's max_num_samples), got 33"),
    ("greedy-perturbate", 1, 17, "beam_size must be between 1 and 16 (the server's max_beam_size), got 17"),
    ("beam-search-perturbate", 8, 16, "8 x 16 = 128 hypotheses per sequence with beam-search-perturbate; the "
                                      "server's max_samples_x_beams is 64"),
    ("beam-search-perturbate-sample", 5, 13, "max_samples_x_beams is 64"),
])
def test_limits_bound_one_requests_work_and_name_the_limit(method, num_samples, beam_size, message):
    arguments: dict[str, Any] = dict(scaled_radius=1.0, top_k=0, top_p=0.9, temperature=1.0)
    with pytest.raises(GenerationError) as error:
        check_sampling_arguments(method, num_samples, beam_size, limits=LIMITS, **arguments)
    assert message in str(error.value)
    # At the limits, and without limits (the library's own use), the same arguments are fine.
    check_sampling_arguments(method, num_samples, beam_size, **arguments)
    check_sampling_arguments("beam-search-perturbate", 4, 16, limits=LIMITS, **arguments)
    check_sampling_arguments("beam-search-single-sample", 32, 16, limits=LIMITS, **arguments)
    check_sampling_arguments("greedy-perturbate", 32, 16, limits=LIMITS, **arguments)


def test_decode_tokens_bound_requests_and_the_batches_they_join():
    check_decode_tokens(64, 512, 32768, "request")
    with pytest.raises(GenerationError, match=r"^request = 32896 tokens of hidden states to decode; the server's "
                                              r"max_decode_tokens is 32768$"):
        check_decode_tokens(64, 514, 32768, "request")
    # Consecutive requests join while rows x longest length fits; one over the limit stands alone.
    assert split_by_tokens([(4, 10), (4, 20), (2, 5), (10, 30), (1, 100)], 200) == [[0, 1, 2], [3], [4]]
    assert split_by_tokens([(50, 10), (1, 1)], 100) == [[0], [1]]
    assert split_by_tokens([], 100) == []


def test_messages_name_the_argument_as_the_caller_labels_it():
    with pytest.raises(GenerationError, match=r"^input 'top_p' row 0 must be finite, got nan$"):
        check_sampling_arguments("greedy-perturbate", 1, 5, 1.0, 0, float("nan"), 1.0,
                                 label=lambda name: f"input '{name}' row 0")


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("method", ["greedy-perturbate", "topkp-perturbate", "beam-search-perturbate",
                                    "beam-search-single-sample"])
def test_overflowing_rows_are_an_error_naming_them_not_garbage(method):
    hiddens, mask = inputs(batch=4)
    hiddens[2] = 1e38  # finite, but the decoder's arithmetic overflows
    with pytest.raises(TooLargeError) as error:
        generate(ToyDecoder(), hiddens, mask, method=method, num_samples=2, scaled_radius=0.0,
                 rng=np.random.default_rng(0), max_length=4, beam_size=2, **KW)
    copies = 1 if method == "beam-search-single-sample" else 2
    assert error.value.rows == [2 + 4 * copy for copy in range(copies)]  # sample-major batch rows
    assert "the decoder's output is not finite" in str(error.value) and "row(s) [2" in str(error.value)


def test_perturbation_that_overflows_or_exceeds_the_magnitude_names_the_rows():
    hiddens, mask = inputs(batch=3)
    hiddens[1] = 3.4e38  # float32's largest is 3.40282e38: any positive noise overflows
    mask[1] = True
    with pytest.raises(TooLargeError, match=r"^perturbed hiddens in batch row\(s\) \[1\]: not finite"):
        perturb(hiddens, mask, np.random.default_rng(0), 2e37)
    hiddens[1] = 0.0
    assert np.isfinite(perturb(hiddens, mask, np.random.default_rng(0), 2e37)).all()
    with pytest.raises(TooLargeError, match=r"row\(s\) \[0, 1, 2\]: values up to .*; the largest magnitude a "
                                            r"decode accepts is 100 \(max_hidden_magnitude\)"):
        perturb(hiddens, mask, np.random.default_rng(0), 1e3, max_magnitude=100)
    assert perturb(hiddens, mask, np.random.default_rng(0), 1.0, max_magnitude=100).shape == hiddens.shape


def test_hiddens_over_the_magnitude_limit_are_refused():
    hiddens, mask = inputs(batch=3)
    validate_hiddens(hiddens, mask, max_magnitude=100)
    hiddens[2, 0, 0] = 1e38
    with pytest.raises(TooLargeError, match=r"^hiddens in batch row\(s\) \[2\]: values up to 1e\+38"):
        validate_hiddens(hiddens, mask, max_magnitude=100)


def bad_hiddens():
    hiddens, mask = inputs(batch=3)
    nan, inf, no_position = hiddens.copy(), hiddens.copy(), mask.copy()
    nan[0, -1, 0], inf[2, 0, 1] = np.nan, np.inf  # a padded position counts too
    no_position[1] = False
    return [
        (hiddens[:, :-1], mask, "does not match"),
        (hiddens[0], mask[0], "3-D"),
        (hiddens, mask.astype(np.int64), "mask must be a bool array"),
        (hiddens.astype(np.int64), mask, "hiddens must be floating point"),
        (hiddens[:0], mask[:0], "non-empty"),
        (hiddens, no_position, "row(s) [1]"),
        (nan, mask, "NaN or Inf values in batch row(s) [0]"),
        (inf, mask, "NaN or Inf values in batch row(s) [2]"),
    ]


@pytest.mark.parametrize("hiddens, mask, message", bad_hiddens())
def test_bad_hiddens_are_rejected_everywhere(hiddens, mask, message):
    with pytest.raises(GenerationError) as error:
        validate_hiddens(hiddens, mask)
    assert message in str(error.value)
    with pytest.raises(GenerationError):
        generate(ToyDecoder(), hiddens, mask, method="greedy-perturbate", num_samples=1, scaled_radius=1.0,
                 rng=np.random.default_rng(0), max_length=4, **KW)
    with pytest.raises(GenerationError):
        beam_search(ToyDecoder(), hiddens, mask, max_length=4, beam_size=2, **KW)


def test_direct_calls_check_their_arguments():
    hiddens, mask = inputs()
    with pytest.raises(GenerationError, match="beam_size"):
        beam_search(ToyDecoder(), hiddens, mask, max_length=4, beam_size=0, **KW)
    with pytest.raises(GenerationError, match="length_penalty"):
        beam_search(ToyDecoder(), hiddens, mask, max_length=4, beam_size=2, length_penalty=float("nan"), **KW)
    with pytest.raises(GenerationError, match="top_p"):
        sample_top_k_top_p(ToyDecoder(), hiddens, mask, np.random.default_rng(0), max_length=4, top_p=2.0,
                           **KW)
    with pytest.raises(GenerationError, match="max_length"):
        greedy(ToyDecoder(), hiddens, mask, max_length=-1, **KW)
    with pytest.raises(GenerationError, match="scaled_radius"):
        perturb(hiddens, mask, np.random.default_rng(0), -1.0)
