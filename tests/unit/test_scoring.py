"""N_scores logic (bionemo_export/serving/scoring.py), without a server: every refused request with
its exact message, the limits, and the scores against a brute-force reference that runs one copy
per mutation on a deterministic numpy fake of a masked LM. The served path against ESM's predict.py
formula in transformers' own EsmForMaskedLM is test_scores_model.py (and, served, the masked-LM
end-to-end tests)."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
from typing import Any

import numpy as np
import pytest

from bionemo_export.serving import scoring
from bionemo_export.serving.scoring import (
    METHODS,
    ScoringError,
    ScoringLimits,
    masked_sequences,
    mutated_positions,
    pack_passes,
    parse_variant,
    parse_variants,
    plan_request,
    resolve_method,
)

AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"
WILD_TYPE = "MSLKRKNIALIPAAGIGVRFG"  # 21 residues: M1 S2 L3 K4 R5 K6 N7 I8 A9 L10 ...
MASK_CHAR = "_"


def _error(call, *args, **kwargs) -> str:
    with pytest.raises(ScoringError) as caught:
        call(*args, **kwargs)
    return str(caught.value)


# ----------------------------------------------------------------------------------- the module
def test_module_imports_only_the_standard_library_and_numpy():
    """The file is copied into generated model folders: no torch, transformers or bionemo_export."""
    tree = ast.parse(pathlib.Path(scoring.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module is not None, "relative imports break the copy in a model folder"
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "re", "collections", "dataclasses", "typing", "numpy"}, imported


def test_scoring_error_is_a_value_error():
    assert issubclass(ScoringError, ValueError)


# ----------------------------------------------------------------------------------- variant errors
@pytest.mark.parametrize("variants, message", [
    (["M1A", ""], "variants[1] is empty; write a variant like A42G, or A42G:L43P for a multi-mutant"),
    ([" M1A"], "variants[0] = ' M1A': contains whitespace; write a variant like A42G or A42G:L43P, with no spaces"),
    (["M1A\n"], "variants[0] = 'M1A\\n': contains whitespace; write a variant like A42G or A42G:L43P, with no "
                "spaces"),
    (["M1A: S2A"], "variants[0] = 'M1A: S2A': contains whitespace; write a variant like A42G or A42G:L43P, with "
                   "no spaces"),
    (["M1"], "variants[0] = 'M1': not a mutation; write the wild-type residue, its 1-based position and the "
             "mutant residue, like A42G"),
    (["1MA"], "variants[0] = '1MA': not a mutation; write the wild-type residue, its 1-based position and the "
              "mutant residue, like A42G"),
    (["M1AA"], "variants[0] = 'M1AA': not a mutation; write the wild-type residue, its 1-based position and the "
               "mutant residue, like A42G"),
    (["M-1A"], "variants[0] = 'M-1A': not a mutation; write the wild-type residue, its 1-based position and the "
               "mutant residue, like A42G"),
    (["M1A", "S2A;L3A"], "variants[1] = 'S2A;L3A': not a mutation; write the wild-type residue, its 1-based "
                         "position and the mutant residue, like A42G"),
    (["A42G"], "variants[0] = 'A42G': position 42 is out of range: the wild type has 21 residues (positions 1 "
               "to 21)"),
    (["M0A"], "variants[0] = 'M0A': position 0 is out of range: the wild type has 21 residues (positions 1 to 21)"),
    (["G22A"], "variants[0] = 'G22A': position 22 is out of range: the wild type has 21 residues (positions 1 "
               "to 21)"),
    (["A1G"], "variants[0] = 'A1G': position 1 is M in the wild type, not A"),
    (["m1A"], "variants[0] = 'm1A': position 1 is M in the wild type, not m"),
    (["M1J"], "variants[0] = 'M1J': the mutant residue 'J' is not in the model's alphabet "
              "(ACDEFGHIKLMNPQRSTVWY)"),
    (["M1a"], "variants[0] = 'M1a': the mutant residue 'a' is not in the model's alphabet "
              "(ACDEFGHIKLMNPQRSTVWY)"),
    (["M1*"], "variants[0] = 'M1*': the mutant residue '*' is not in the model's alphabet "
              "(ACDEFGHIKLMNPQRSTVWY)"),
    (["M1A:M1C"], "variants[0] = 'M1A:M1C': position 1 is mutated twice (M1A and M1C); a variant mutates a "
                  "position once"),
    (["M1A:S2A:M01C"], "variants[0] = 'M1A:S2A:M01C': position 1 is mutated twice (M1A and M1C); a variant "
                       "mutates a position once"),
    (["M1A:"], "variants[0] = 'M1A:': mutation 2 is empty; join mutations with a single ':', like A42G:L43P"),
    (["M1A::S2A"], "variants[0] = 'M1A::S2A': mutation 2 is empty; join mutations with a single ':', like "
                   "A42G:L43P"),
    ([":"], "variants[0] = ':': mutation 1 is empty; join mutations with a single ':', like A42G:L43P"),
    (["M1A:A2G"], "variants[0] = 'M1A:A2G': mutation 2 'A2G': position 2 is S in the wild type, not A"),
    (["M1A:S99A"], "variants[0] = 'M1A:S99A': mutation 2 'S99A': position 99 is out of range: the wild type has "
                   "21 residues (positions 1 to 21)"),
    (["M1A:S2J"], "variants[0] = 'M1A:S2J': mutation 2 'S2J': the mutant residue 'J' is not in the model's "
                  "alphabet (ACDEFGHIKLMNPQRSTVWY)"),
    (["M1A:S2"], "variants[0] = 'M1A:S2': mutation 2 'S2': not a mutation; write the wild-type residue, its "
                 "1-based position and the mutant residue, like A42G"),
    ([b"\xffM1A"], "variants[0] is not UTF-8 (invalid start byte at byte 0)"),
    ([5], "variants[0] must be a string, got int"),
])
def test_bad_variants_are_refused_naming_the_variant(variants, message):
    assert _error(parse_variants, variants, WILD_TYPE, AMINO_ACIDS) == message
    # The whole request refuses it the same way, whichever marginal method it asks for.
    for method in ("wt-marginal", "masked-marginal"):
        assert _error(plan_request, WILD_TYPE, variants, method, alphabet=AMINO_ACIDS) == message


def test_a_wild_type_residue_outside_the_alphabet_cannot_be_mutated():
    wild_type = "MSLKXKN"
    assert _error(parse_variants, ["X5A"], wild_type, AMINO_ACIDS) == (
        "variants[0] = 'X5A': the wild-type residue 'X' at position 5 is not in the model's alphabet "
        "(ACDEFGHIKLMNPQRSTVWY): it has no log-probability to compare with")
    # It is context elsewhere: neighbouring mutations parse.
    assert [str(m) for m in parse_variants(["K4A:K6C"], wild_type, AMINO_ACIDS)[0].mutations] == ["K4A", "K6C"]


def test_long_variants_are_cut_in_messages():
    text = "M1A:" * 40 + "S2"
    message = _error(parse_variants, [text], WILD_TYPE, AMINO_ACIDS)
    assert message.startswith(f"variants[0] = {text[:60]!r}"[:-1] + "...': ")
    assert len(message) < 300
    digits = "9" * 5000  # past int()'s own digit limit: still this module's error
    message = _error(parse_variants, ["M" + digits + "A"], WILD_TYPE, AMINO_ACIDS)
    assert "position " + "9" * 60 + "... is out of range: the wild type has 21 residues" in message
    assert len(message) < 300
    assert _error(parse_variants, ["M0000000000000000000001A:M1C"], WILD_TYPE, AMINO_ACIDS).endswith(
        "position 1 is mutated twice (M1A and M1C); a variant mutates a position once")


def test_variants_parse_to_mutations():
    variants = parse_variants(["M1A", b"S2A:L3P", "K4K", "R5C:M1D"], WILD_TYPE, AMINO_ACIDS)
    assert [v.text for v in variants] == ["M1A", "S2A:L3P", "K4K", "R5C:M1D"]
    assert [[(m.wild_type, m.position, m.mutant, m.index) for m in v.mutations] for v in variants] == [
        [("M", 1, "A", 0)], [("S", 2, "A", 1), ("L", 3, "P", 2)], [("K", 4, "K", 3)],
        [("R", 5, "C", 4), ("M", 1, "D", 0)]]
    assert mutated_positions(variants).tolist() == [0, 1, 2, 3, 4]
    assert parse_variant("M1A", WILD_TYPE, AMINO_ACIDS, index=7).mutations[0].position == 1
    assert _error(parse_variant, "A1G", WILD_TYPE, AMINO_ACIDS, index=7).startswith("variants[7] = 'A1G': ")


@pytest.mark.parametrize("alphabet, message", [
    ("AAC", "alphabet has 'A' twice (columns 0 and 1)"),
    (["A", "CD"], "alphabet entry 1 is 'CD', not a single character"),
    ("", "the alphabet is empty"),
])
def test_a_bad_alphabet_is_the_callers_bug(alphabet, message):
    with pytest.raises(ValueError) as caught:
        parse_variants(["M1A"], WILD_TYPE, alphabet)
    assert not isinstance(caught.value, ScoringError)
    assert str(caught.value) == message


# ----------------------------------------------------------------------------------- methods
def test_method_defaults_and_errors():
    assert resolve_method(None, True) == "wt-marginal"
    assert resolve_method(None, False) == "pll"
    assert resolve_method(b"", True) == "wt-marginal"
    assert resolve_method(b"masked-marginal", True) == "masked-marginal"
    assert resolve_method("pll", False) == "pll"
    assert resolve_method(None, True, "variant-masked") == "variant-masked"  # a model's default_method
    assert resolve_method(None, False, "variant-masked") == "pll"
    assert resolve_method("wt-marginal", True, "variant-masked") == "wt-marginal"
    assert _error(resolve_method, "masked-marginals", True) == (
        "input method: unknown method 'masked-marginals'; methods: wt-marginal, masked-marginal, variant-masked, pll")
    assert _error(resolve_method, "pll", True) == (
        "input method: pll scores the wild-type sequence itself and takes no variants; use wt-marginal, "
        "masked-marginal or variant-masked to score variants, or send each mutant sequence with method pll")
    for method in ("wt-marginal", "masked-marginal", "variant-masked"):
        assert _error(resolve_method, method, False) == (
            f"input method: {method} scores variants, and the request has none; send variants (like A42G), or "
            "use method pll to score the sequence itself")
    assert _error(resolve_method, b"\xff", False) == "input method is not UTF-8 (invalid start byte at byte 0)"
    assert METHODS == ("wt-marginal", "masked-marginal", "variant-masked", "pll")


def test_plan_request_defaults_and_sequence_errors():
    assert plan_request(WILD_TYPE, ["M1A"], None, alphabet=AMINO_ACIDS).method == "wt-marginal"
    assert plan_request(WILD_TYPE, None, None, alphabet=AMINO_ACIDS).method == "pll"
    assert plan_request(WILD_TYPE, [], None, alphabet=AMINO_ACIDS).method == "pll"  # empty: no variants
    assert plan_request(WILD_TYPE.encode(), None, b"pll", alphabet=AMINO_ACIDS).wild_type == WILD_TYPE
    assert _error(plan_request, "", ["M1A"], None, alphabet=AMINO_ACIDS) == (
        "input sequences: the wild-type sequence is empty")
    assert _error(plan_request, b"", None, None, alphabet=AMINO_ACIDS) == (
        "input sequences: the wild-type sequence is empty")
    assert _error(plan_request, "MS_K", ["M1A"], None, alphabet=AMINO_ACIDS, mask_char=MASK_CHAR) == (
        "input sequences: position 3 is the mask character '_'; a wild type to score has no masked residues")
    assert _error(plan_request, b"M\xc3", None, None, alphabet=AMINO_ACIDS) == (
        "input sequences is not UTF-8 (unexpected end of data at byte 1)")


def test_pll_refuses_residues_outside_the_alphabet_naming_the_position():
    assert _error(plan_request, "MSLKXKN", None, "pll", alphabet=AMINO_ACIDS) == (
        "input sequences: method pll: residue 5 is 'X', which is not in the model's alphabet "
        "(ACDEFGHIKLMNPQRSTVWY): it has no log-probability, so the sequence has no PLL")
    # The marginals read X as context.
    plan = plan_request("MSLKXKN", ["K4A"], "masked-marginal", alphabet=AMINO_ACIDS)
    assert plan.positions.tolist() == [3]


# ----------------------------------------------------------------------------------- limits
def test_limits_defaults_parameters_and_validation():
    limits = ScoringLimits()
    assert limits.parameters() == {"max_variants": "32768", "max_mutations_per_variant": "64",
                                   "max_masked_copies": "1024"}
    assert ScoringLimits.from_parameters(limits.parameters()) == limits
    custom = ScoringLimits(max_variants=10, max_mutations_per_variant=3, max_masked_copies=5)
    assert ScoringLimits.from_parameters({**custom.parameters(), "max_batch_size": "32"}) == custom
    assert ScoringLimits.from_parameters({"max_masked_copies": "7"}) == ScoringLimits(max_masked_copies=7)
    with pytest.raises(ValueError, match=r"^parameter max_variants is 'many', not an integer$"):
        ScoringLimits.from_parameters({"max_variants": "many"})
    with pytest.raises(ValueError, match=r"^max_masked_copies must be an integer of at least 1, got 0$"):
        ScoringLimits.from_parameters({"max_masked_copies": "0"})
    bad_values: tuple[Any, ...] = (0, -3, 2.5, True, "8")  # wrong on purpose: the check is at run time
    for bad in bad_values:
        with pytest.raises(ValueError, match=r"^max_variants must be an integer of at least 1, got "):
            ScoringLimits(max_variants=bad)
    for name in ("max_variants", "max_mutations_per_variant", "max_masked_copies"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(limits, name, 3)


def test_limits_are_enforced_naming_the_limit_and_the_value():
    limits = ScoringLimits(max_variants=2, max_mutations_per_variant=2, max_masked_copies=2)
    assert _error(plan_request, WILD_TYPE, ["M1A", "S2A", "L3A"], None, alphabet=AMINO_ACIDS, limits=limits) == (
        "input variants: 3 variants; the server's max_variants is 2")
    assert _error(plan_request, WILD_TYPE, ["M1A:S2A:L3A"], None, alphabet=AMINO_ACIDS, limits=limits) == (
        "variants[0] = 'M1A:S2A:L3A': 3 mutations; the server's max_mutations_per_variant is 2")
    assert _error(plan_request, WILD_TYPE, ["M1A", "S2A:L3A"], "masked-marginal", alphabet=AMINO_ACIDS,
                  limits=limits) == (
        "method masked-marginal: 3 masked copies of the sequence (one per distinct mutated position); the "
        "server's max_masked_copies is 2")
    # Copies are per distinct position: two variants at two positions fit, whatever they mutate to.
    plan = plan_request(WILD_TYPE, ["M1A", "M1C:S2D"], "masked-marginal", alphabet=AMINO_ACIDS, limits=limits)
    assert plan.positions.tolist() == [0, 1] and plan.passes == 2
    # wt-marginal runs one pass whatever the positions.
    plan = plan_request(WILD_TYPE, ["M1A", "S2A:L3A"], "wt-marginal", alphabet=AMINO_ACIDS, limits=limits)
    assert plan.positions.tolist() == [0, 1, 2] and plan.passes == 1
    assert _error(plan_request, WILD_TYPE, None, "pll", alphabet=AMINO_ACIDS,
                  limits=ScoringLimits(max_masked_copies=20)) == (
        "method pll: 21 masked copies of the sequence (one per residue); the server's max_masked_copies is 20")
    assert plan_request(WILD_TYPE, None, "pll", alphabet=AMINO_ACIDS,
                        limits=ScoringLimits(max_masked_copies=21)).passes == 21


# ----------------------------------------------------------------------------------- copies and chunks
def test_masked_copies_as_strings():
    assert masked_sequences("MSLK", [0, 2], MASK_CHAR) == ["_SLK", "MS_K"]
    assert masked_sequences("MSLK", np.array([], dtype=np.int64), MASK_CHAR) == []
    plan = plan_request("MSLK", ["S2A", "S2C:K4A"], "masked-marginal", alphabet=AMINO_ACIDS)
    assert plan.inputs(MASK_CHAR) == ["M_LK", "MSL_"]
    assert plan.inputs(MASK_CHAR, slice(1, 2)) == ["MSL_"]
    plan = plan_request("MSLK", ["S2A"], "wt-marginal", alphabet=AMINO_ACIDS)
    assert plan.inputs(MASK_CHAR) == ["MSLK"]


def test_pack_passes_fills_every_call_but_the_last_across_plans():
    assert pack_passes([], 4) == [] and pack_passes([0, 0], 4) == []
    assert pack_passes([10], 4) == [[(0, slice(0, 4))], [(0, slice(4, 8))], [(0, slice(8, 10))]]
    assert pack_passes([3, 1, 0, 6], 4) == [[(0, slice(0, 3)), (1, slice(0, 1))], [(3, slice(0, 4))],
                                            [(3, slice(4, 6))]]
    assert pack_passes([1, 1, 1], 32) == [[(0, slice(0, 1)), (1, slice(0, 1)), (2, slice(0, 1))]]
    assert pack_passes([5, 5], 3) == [[(0, slice(0, 3))], [(0, slice(3, 5)), (1, slice(0, 1))],
                                      [(1, slice(1, 4))], [(1, slice(4, 5))]]
    with pytest.raises(ValueError, match="at least 1"):
        pack_passes([3], 0)


def test_inputs_of_a_part_are_that_slice_of_the_inputs():
    plan = plan_request("MSLKV", None, "pll", alphabet=AMINO_ACIDS, mask_char=MASK_CHAR)
    assert plan.inputs(MASK_CHAR, slice(1, 3)) == plan.inputs(MASK_CHAR)[1:3] == ["M_LKV", "MS_KV"]
    wild = plan_request("MSLKV", ["S2A"], None, alphabet=AMINO_ACIDS)
    assert wild.inputs(MASK_CHAR, slice(0, 1)) == wild.inputs(MASK_CHAR) == ["MSLKV"]


def test_wrong_log_prob_shapes_are_the_callers_bug():
    plan = plan_request("MSLK", ["S2A", "K4A"], "masked-marginal", alphabet=AMINO_ACIDS)
    with pytest.raises(ValueError) as caught:
        plan.site_log_probs(np.zeros((2, 5, 20)))
    assert not isinstance(caught.value, ScoringError)
    assert str(caught.value) == ("log_probs of inputs[0:2] must have shape (2, 4, 20) (copies, residues, "
                                 "alphabet), got (2, 5, 20)")
    with pytest.raises(ValueError, match=r"inputs\[1:2\] must have shape \(1, 4, 20\)"):
        plan.site_log_probs(np.zeros((2, 4, 20)), slice(1, 2))
    with pytest.raises(ValueError, match=r"site log-probabilities must have shape \(2, 20\)"):
        plan.scores(np.zeros((3, 20)))


def test_a_mutation_to_the_wild_type_residue_scores_zero():
    plan = plan_request("MSLK", ["S2S", "S2S:K4K"], "wt-marginal", alphabet=AMINO_ACIDS)
    log_probs = np.log(np.random.default_rng(0).dirichlet(np.ones(20), size=4))
    assert plan.scores(plan.site_log_probs(log_probs)).tolist() == [0.0, 0.0]


# ----------------------------------------------------------------------------------- a numpy fake model
class FakeMaskedLM:
    """A deterministic stand-in for a masked LM: token row -> log-probabilities over the alphabet,
    each row depending on its own token, its position and the whole row (so masking one residue
    changes every row's prediction, as attention does)."""

    def __init__(self, alphabet: str, seed: int = 0) -> None:
        self.alphabet = alphabet
        self.vocab = ["<bos>", "<eos>", "<mask>", "<unk>", *alphabet]
        self.ids = {token: i for i, token in enumerate(self.vocab)}
        rng = np.random.default_rng(seed)
        self.embed = rng.normal(size=(len(self.vocab), 16))
        self.own = rng.normal(size=(16, len(alphabet)))
        self.context = rng.normal(size=(16, len(alphabet)))
        self.position = rng.normal(size=(64, len(alphabet)))

    def tokenize(self, text: str) -> np.ndarray:
        """BOS + one id per character (the mask character -> <mask>, unknown -> <unk>) + EOS."""
        body = [self.ids["<mask>"] if c == MASK_CHAR else self.ids.get(c, self.ids["<unk>"]) for c in text]
        return np.array([self.ids["<bos>"], *body, self.ids["<eos>"]], dtype=np.int64)

    def __call__(self, row: np.ndarray) -> np.ndarray:
        """[T, A] log-probabilities over the alphabet for every token of `row`."""
        vectors = self.embed[row]
        logits = np.tanh(vectors) @ self.own + np.tanh(vectors.mean(0)) @ self.context + self.position[:len(row)]
        logits = logits - logits.max(1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(1, keepdims=True))


def _brute_force_marginal(model: FakeMaskedLM, wild_type: str, variant: str, masked: bool) -> float:
    """ESM's formula, one mutation and one model call at a time, copies built by hand."""
    total = 0.0
    for mutation in variant.split(":"):
        wt, position, mt = mutation[0], int(mutation[1:-1]), mutation[-1]
        row = model.tokenize(wild_type)
        if masked:
            row[position] = model.ids["<mask>"]  # residue position-1 sits at token position (after BOS)
        log_probs = model(row)[position]
        total += log_probs[model.alphabet.index(mt)] - log_probs[model.alphabet.index(wt)]
    return total


def _brute_force_pll(model: FakeMaskedLM, sequence: str) -> float:
    values = []
    for i, residue in enumerate(sequence):
        row = model.tokenize(sequence)
        row[1 + i] = model.ids["<mask>"]
        values.append(model(row)[1 + i, model.alphabet.index(residue)])
    return float(np.mean(values))


def _served_scores(plan, run_rows, chunk: int) -> np.ndarray:
    """What the served model does: copies in calls of at most `chunk`, site rows kept, scores at the end."""
    sites = [plan.site_log_probs(run_rows(plan.inputs(MASK_CHAR, part)), part)
             for call in pack_passes([plan.passes], chunk) for _, part in call]
    return plan.scores(np.concatenate(sites))


def _random_variants(rng, wild_type: str, alphabet: str, count: int, *, exclude: str = "") -> list[str]:
    positions = [i for i, c in enumerate(wild_type) if c in alphabet and c not in exclude]
    variants = []
    for _ in range(count):
        chosen = sorted(rng.choice(positions, size=int(rng.integers(1, 4)), replace=False))
        variants.append(":".join(f"{wild_type[p]}{p + 1}{rng.choice(list(alphabet))}" for p in chosen))
    return variants


@pytest.mark.parametrize("method", ["wt-marginal", "masked-marginal"])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_marginal_scores_match_a_brute_force_fake_model(method, chunk):
    model = FakeMaskedLM(AMINO_ACIDS)
    rng = np.random.default_rng(1)
    wild_type = "".join(rng.choice(list(AMINO_ACIDS), size=30)) + "X" + "".join(rng.choice(list(AMINO_ACIDS), 9))
    variants = _random_variants(rng, wild_type, AMINO_ACIDS, 25) + [f"{wild_type[0]}1{wild_type[0]}"]
    plan = plan_request(wild_type, variants, method, alphabet=AMINO_ACIDS, mask_char=MASK_CHAR)
    assert plan.passes == (1 if method == "wt-marginal" else len({int(m[1:-1]) for v in variants
                                                                  for m in v.split(":")}))

    def run_rows(texts):  # [n, L, A]: BOS/EOS rows dropped
        return np.stack([model(model.tokenize(text))[1:-1] for text in texts]).astype(np.float32)

    scores = _served_scores(plan, run_rows, chunk)
    expected = [_brute_force_marginal(model, wild_type, v, method == "masked-marginal") for v in variants]
    assert scores.dtype == np.float32 and scores.shape == (len(variants),)
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-5)
    assert scores[-1] == 0.0


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_pll_matches_a_brute_force_fake_model(chunk):
    model = FakeMaskedLM(AMINO_ACIDS, seed=3)
    plan = plan_request(WILD_TYPE, None, None, alphabet=AMINO_ACIDS, mask_char=MASK_CHAR)
    assert plan.method == "pll" and plan.positions.tolist() == list(range(len(WILD_TYPE)))
    run_rows = lambda texts: np.stack([model(model.tokenize(text))[1:-1] for text in texts])  # noqa: E731
    scores = _served_scores(plan, run_rows, chunk)
    assert scores.dtype == np.float32 and scores.shape == (1,)
    np.testing.assert_allclose(scores[0], _brute_force_pll(model, WILD_TYPE), rtol=1e-6)


def test_the_wt_marginal_pass_accepts_a_two_dimensional_log_prob_array():
    model = FakeMaskedLM(AMINO_ACIDS)
    plan = plan_request(WILD_TYPE, ["M1A", "S2C:I8K"], None, alphabet=AMINO_ACIDS)
    log_probs = model(model.tokenize(WILD_TYPE))[1:-1]
    np.testing.assert_array_equal(plan.scores(plan.site_log_probs(log_probs)),
                                  plan.scores(plan.site_log_probs(log_probs[None])))


def test_masking_changes_the_scores():
    """The two marginals read different passes (a plan that forgot to mask would pass the brute-force
    tests of each method only if the reference forgot too)."""
    model = FakeMaskedLM(AMINO_ACIDS)
    run_rows = lambda texts: np.stack([model(model.tokenize(text))[1:-1] for text in texts])  # noqa: E731
    variants = ["M1A", "S2C:I8K", "G21W"]
    scores = {method: _served_scores(plan_request(WILD_TYPE, variants, method, alphabet=AMINO_ACIDS), run_rows, 2)
              for method in ("wt-marginal", "masked-marginal")}
    assert np.abs(scores["wt-marginal"] - scores["masked-marginal"]).min() > 1e-3


# ----------------------------------------------------------------------------------- variant-masked
def test_variant_masked_runs_one_copy_per_set_of_positions_and_reads_each_variant_from_its_own():
    """SaProt's convention for any family: every mutated position of a variant masked at once, one
    copy per distinct set (in the order the variants name them), each mutation read from that copy."""
    alphabet = tuple(AMINO_ACIDS)
    variants = ["S2A", "S2C:K4A", "K4G:S2D", "L3L", "S2W"]
    plan = plan_request("MSLK", variants, "variant-masked", alphabet=alphabet, mask_char=MASK_CHAR)
    assert plan.copies == ((1,), (1, 3), (2,)) and plan.passes == 3
    assert plan.inputs(MASK_CHAR) == ["M_LK", "M_L_", "MS_K"]
    assert plan.inputs(MASK_CHAR, slice(1, 3)) == ["M_L_", "MS_K"]
    log_probs = np.log(np.random.default_rng(3).dirichlet(np.ones(len(alphabet)), size=(3, 4)))
    sites = plan.site_log_probs(log_probs)
    assert sites.shape == (4, len(alphabet))  # copy 0: 1 site, copy 1: 2, copy 2: 1
    np.testing.assert_array_equal(np.concatenate([plan.site_log_probs(log_probs[:1], slice(0, 1)),
                                                  plan.site_log_probs(log_probs[1:], slice(1, 3))]), sites)

    def at(copy: int, position: int, residue: str) -> float:
        return float(log_probs[copy, position, AMINO_ACIDS.index(residue)])

    expected = [at(0, 1, "A") - at(0, 1, "S"),
                at(1, 1, "C") - at(1, 1, "S") + at(1, 3, "A") - at(1, 3, "K"),
                at(1, 3, "G") - at(1, 3, "K") + at(1, 1, "D") - at(1, 1, "S"),
                0.0,
                at(0, 1, "W") - at(0, 1, "S")]
    np.testing.assert_allclose(plan.scores(sites), expected, rtol=1e-6)
    limits = ScoringLimits(max_masked_copies=2)
    assert _error(plan_request, "MSLK", variants, "variant-masked", alphabet=alphabet, limits=limits) == (
        "method variant-masked: 3 masked copies of the sequence (one per distinct set of mutated positions); the "
        "server's max_masked_copies is 2")
    assert plan_request("MSLK", variants, None, alphabet=alphabet, default_method="variant-masked").method == \
        "variant-masked"


def test_structure_aware_copies_keep_each_residues_3di_letter():
    """With a structure-aware reader, variants index residues, and every copy is spelled residue +
    3Di letter, the masked residue `#` followed by its own letter (SaProt's `#d`)."""
    from bionemo_export.serving.tokenizers.structure_aware import split_pairs

    alphabet = tuple(AMINO_ACIDS)
    for method, inputs in (("variant-masked", ["#dEv#p", "Md#vVp"]), ("masked-marginal", ["#dEvVp", "Md#vVp",
                                                                                          "MdEv#p"]),
                           ("wt-marginal", ["MdEvVp"])):
        plan = plan_request("MdEvVp", ["M1A:V3L", "E2K"], method, alphabet=alphabet, mask_char="#",
                            split_structure=split_pairs)
        assert plan.wild_type == "MEV" and plan.structure == "dvp"
        assert plan.inputs("#") == inputs
    plain = plan_request("MEV", ["M1A:V3L"], "variant-masked", alphabet=alphabet, mask_char="#",
                         split_structure=split_pairs)
    assert plain.inputs("#") == ["##E###"]
