"""N_scores' served logic (serving/scores.py) without a server: requests through the fake
`triton_python_backend_utils`, its BLS calls to N_logits answered by the package's own PyTorch
encoder and masked-LM head of a tiny random ESM-2 (as the served N_logits computes them), and the
scores compared with a brute-force reference in transformers' own `EsmForMaskedLM` that masks one
copy at a time and applies ESM's predict.py formula over the whole vocabulary (and AntiBERTy's PLL:
mean log-probability, special tokens excluded from the softmax)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from bionemo_export.models import get_family
from bionemo_export.serving.responses import Responder
from bionemo_export.serving.scores import VariantScorer
from bionemo_export.serving.scoring import ScoringLimits
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.helpers import fake_pb_utils
from tests.helpers.masked_lm_reference import brute_force, brute_force_pll

WILD_TYPE = "MKTAYIAKQRQISFVKSHFSRQ"
VARIANTS = ["M1A", "K2R:T3S", "Y5W", "A4A", "Q22E:R21K:S20T"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    checkpoint = save_random_checkpoint("esm2", tmp_path_factory.mktemp("esm2") / "ckpt", seed=7)
    loaded = get_family("esm2").load(checkpoint)
    reference = transformers.EsmForMaskedLM.from_pretrained(checkpoint).eval()
    return loaded, reference


@pytest.fixture
def pb_utils(monkeypatch):
    return fake_pb_utils.install(monkeypatch)


def served_logits(loaded, calls):
    """N_logits as the repository computes it: the package's encoder, then its head."""
    def run(sequences: list[str]):
        calls.append(len(sequences))
        encoded = loaded.tokenizer.encode(sequences)
        with torch.inference_mode():
            hiddens, _ = loaded.encoder(*(torch.from_numpy(a) for a in (encoded.input_ids, encoded.attention_mask,
                                                                         encoded.residue_mask)))
            log_probs = loaded.lm_head(hiddens).numpy()
        return log_probs, encoded.residue_mask
    return run


def scorer(loaded, calls, chunk=4, limits=ScoringLimits()):
    return VariantScorer(served_logits(loaded, calls), alphabet=loaded.alphabet, mask_char="_", limits=limits,
                         chunk=chunk, responder=Responder("t_scores"))


def ask(pb_utils, model, inputs):
    response = model.execute([fake_pb_utils.request(inputs)])[0][0]
    return response


def column(*texts: str) -> np.ndarray:
    return np.array([[t.encode()] for t in texts], dtype=np.object_)


@pytest.mark.parametrize("method", ["wt-marginal", "masked-marginal"])
def test_variant_scores_equal_esms_formula_masking_one_copy_at_a_time(pb_utils, model, method):
    loaded, reference = model
    calls: list[int] = []
    response = ask(pb_utils, scorer(loaded, calls), {
        "sequences": column(WILD_TYPE), "variants": np.array([[v.encode() for v in VARIANTS]], dtype=np.object_),
        "method": column(method)})
    assert not response.has_error(), response.error()
    served = response.output("scores")
    assert served.shape == (1, len(VARIANTS)) and served.dtype == np.float32
    np.testing.assert_allclose(served[0], brute_force(reference, WILD_TYPE, VARIANTS, method), atol=1e-4)
    assert served[0, VARIANTS.index("A4A")] == 0.0
    # wt-marginal: one pass; masked-marginal: one copy per DISTINCT mutated position (1-5, 20-22: 8), in calls
    # of at most 4 rows.
    assert calls == ([1] if method == "wt-marginal" else [4, 4])


def test_pll_is_the_mean_log_probability_with_each_residue_masked(pb_utils, model):
    loaded, reference = model
    calls: list[int] = []
    sequences = ["MKTAYIAKQR", "GVSE"]
    response = ask(pb_utils, scorer(loaded, calls, chunk=32), {"sequences": column(*sequences)})
    assert not response.has_error(), response.error()
    served = response.output("scores")
    assert served.shape == (2, 1)
    expected = [brute_force_pll(reference, s, loaded.alphabet) for s in sequences]
    np.testing.assert_allclose(served[:, 0], expected, atol=1e-4)
    assert calls == [14]  # one copy per residue, both sequences' copies packed into one call


@pytest.mark.parametrize("chunk", [1, 3, 6])
def test_rows_of_different_lengths_share_calls_and_keep_their_own_scores(pb_utils, model, chunk):
    """A request's rows are packed into full calls (a call may hold the end of one sequence's
    copies and the start of the next, of another length), and each row still gets its own PLL."""
    loaded, reference = model
    calls: list[int] = []
    sequences = ["MKTAYIAKQR", "GVSE", "MKTAYIAKQRQISF"]
    response = ask(pb_utils, scorer(loaded, calls, chunk=chunk), {"sequences": column(*sequences)})
    assert not response.has_error(), response.error()
    expected = [brute_force_pll(reference, s, loaded.alphabet) for s in sequences]
    np.testing.assert_allclose(response.output("scores")[:, 0], expected, atol=1e-4)
    assert sum(calls) == 28 and calls[:-1] == [chunk] * (len(calls) - 1)


def test_wt_marginal_rows_run_as_one_call(pb_utils, model):
    """Several wild types scored by wt-marginal: one call of all of them, not one call each."""
    loaded, reference = model
    calls: list[int] = []
    wild_types, variants = [WILD_TYPE, WILD_TYPE[:10], WILD_TYPE[5:]], [["M1A", "K2R"], ["M1A", "T3S"], ["I1A", "A2G"]]
    response = ask(pb_utils, scorer(loaded, calls, chunk=32), {
        "sequences": column(*wild_types), "variants": np.array([[v.encode() for v in row] for row in variants],
                                                               dtype=np.object_)})
    assert not response.has_error(), response.error()
    for row, (wild_type, wanted) in enumerate(zip(wild_types, variants)):
        np.testing.assert_allclose(response.output("scores")[row], brute_force(reference, wild_type, wanted,
                                                                               "wt-marginal"), atol=1e-4)
    assert calls == [3]


def test_bad_variants_fail_their_request_with_invalid_argument_naming_them(pb_utils, model):
    loaded, _ = model
    calls: list[int] = []
    cases = {
        "M1A:L2P": "variants[0] = 'M1A:L2P'",  # position 2 is K
        "M99A": "variants[0] = 'M99A'",
        "M1J": "variants[0] = 'M1J'",
    }
    for variant, named in cases.items():
        response = ask(pb_utils, scorer(loaded, calls), {
            "sequences": column(WILD_TYPE), "variants": np.array([[variant.encode()]], dtype=np.object_)})
        assert response.has_error()
        assert response.error().code() == fake_pb_utils.TritonError.INVALID_ARG
        assert response.error().message().startswith("t_scores: ") and named in response.error().message()
    assert calls == [], "a bad request reached the model"


def test_work_over_the_limit_is_refused_before_any_model_call(pb_utils, model):
    loaded, _ = model
    calls: list[int] = []
    response = ask(pb_utils, scorer(loaded, calls, limits=ScoringLimits(max_masked_copies=5)),
                   {"sequences": column(WILD_TYPE), "method": column("pll")})
    assert response.has_error() and "max_masked_copies is 5" in response.error().message()
    assert calls == []


def test_methods_that_do_not_fit_the_inputs_and_bad_shapes_are_named(pb_utils, model):
    loaded, _ = model
    calls: list[int] = []
    no_variants = ask(pb_utils, scorer(loaded, calls), {"sequences": column(WILD_TYPE),
                                                        "method": column("masked-marginal")})
    assert no_variants.has_error() and "masked-marginal scores variants, and the request has none" in \
        no_variants.error().message()
    shape = ask(pb_utils, scorer(loaded, calls), {"sequences": column(WILD_TYPE),
                                                  "variants": np.array([b"M1A"], dtype=np.object_)})
    assert shape.has_error() and "input 'variants' must have shape [1, ...], got [1]" in shape.error().message()
    assert calls == []


def test_the_scorers_inputs_are_the_task_tables():
    """serving/scores.py cannot import the task table (it is copied into repositories): its list of
    N_scores' inputs, which the dev server hands over by name, is kept in step here."""
    from bionemo_export.serving.scores import INPUTS
    from bionemo_export.tasks import TASKS

    assert INPUTS == tuple(t.name for t in TASKS["scores"].inputs)
