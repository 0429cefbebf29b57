"""A checkpoint ensemble served by a real tritonserver: three tiny random ESM-2 members (different
seeds, one of another width), built once as one repository with the Python backend.

References are independent of the package: transformers' own `EsmForMaskedLM` on each member's
files, one member at a time (tests/helpers/masked_lm_reference.py), averaged here. Averaging the
members' log-probabilities and scoring the average must equal averaging each member's scores, ESM's
convention for ESM-1v's five seeds: checked for wt-marginal, masked-marginal and pll.
"""

from __future__ import annotations

import numpy as np
import pytest
import transformers

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.client import RepositoryClient
from bionemo_export.errors import InvalidInputError
from bionemo_export.runtime import TritonServer
from bionemo_export.testing.checkpoints import save_random_checkpoint
from bionemo_export.verify import verify_repository
from tests.helpers.masked_lm_reference import brute_force, brute_force_pll, reference_log_probs

NAME = "ens"
WILD_TYPE = "MKTAYIAKQRQISFVKSHF"
VARIANTS = ["M1A", "K2R:T3S", "Y5W", "A4A", "F19E:H18K"]
SEEDS = [0, 41, 42]
SIZES = [{}, {}, {"hidden_size": 48, "num_heads": 4}]
"""Members' sizes: hidden sizes may differ (no member's hidden states meet another's)."""


def _column(*texts: str) -> np.ndarray:
    return np.array([[t.encode()] for t in texts], dtype=np.object_)


@pytest.fixture(scope="module")
def served(tmp_path_factory, triton_install):
    work = tmp_path_factory.mktemp("ensemble")
    # member 1 is the run's seed-0 ESM-2 (its graphs are exported once for the run), the others new
    checkpoints = [save_random_checkpoint("esm2", work / f"member{n}", seed=seed, **sizes)
                   for n, (seed, sizes) in enumerate(zip(SEEDS, SIZES), 1)]
    result = build_repository(BuildRequest(family="esm2", checkpoint=checkpoints[0], members=tuple(checkpoints[1:]),
                                           name=NAME, out=work / "repo", backend="python", optimize=False))
    references = [transformers.EsmForMaskedLM.from_pretrained(path).eval() for path in checkpoints]
    with TritonServer(work / "repo", install=triton_install, log_file=work / "tritonserver.log") as server:
        url = f"grpc://{server.endpoints.grpc_url}"
        with RepositoryClient(NAME, url) as client:
            yield result, checkpoints, references, client, url


def test_an_ensemble_build_serves_logits_and_scores_from_each_members_graphs(served):
    result, checkpoints, _, _, _ = served
    assert set(result.models) == {f"{NAME}_m{n}_{role}" for n in (1, 2, 3) for role in ("encoder", "lm_head")} | {
        f"{NAME}_member_mean", f"{NAME}_logits", f"{NAME}_scores"}
    manifest = result.manifest
    members = manifest.members or []
    assert manifest.public_models == [f"{NAME}_logits", f"{NAME}_scores"]
    assert [m["member"] for m in members] == ["m1", "m2", "m3"]
    assert [m["path"] for m in members] == [str(path.resolve()) for path in checkpoints]
    assert len({m["digest"] for m in members}) == 3 and manifest.checkpoint == members[0]
    assert [m["hidden"] for m in members] == [32, 32, 48]
    assert set(manifest.verification["graphs"]) == {f"m{n}_{g}" for n in (1, 2, 3) for g in ("encoder", "lm_head")}


def test_served_log_probs_are_the_mean_of_each_members_transformers_log_probs(served):
    _, _, references, client, _ = served
    sequences = ["MKTAYIAKQR", "GV_E", "_SLKRKNIALIPAAGIGVRFG_"]
    log_probs, mask = client.seqs_to_log_probs(sequences)
    assert log_probs.shape == (3, 24, 25) and mask.shape == (3, 24)
    for row, sequence in enumerate(sequences):
        each = [reference_log_probs(reference, sequence, client.alphabet()) for reference in references]
        np.testing.assert_allclose(log_probs[row, :len(sequence) + 2], np.mean(each, axis=0), atol=1e-4)
        assert np.abs(each[0] - each[1]).max() > 1e-2  # the members disagree: the mean is not one of them


def test_each_members_log_probs_come_back_when_asked_for(served):
    _, _, references, client, _ = served
    asked = client.client.infer(f"{NAME}_logits", {"sequences": _column("MKTAYIAKQR", "GVSE")}, ["member_log_probs"])
    assert set(asked) == {"member_log_probs"}
    each = asked["member_log_probs"]
    assert each.dtype == np.float32 and each.shape == (2, 3, 12, 25)
    for k, reference in enumerate(references):
        np.testing.assert_allclose(each[0, k], reference_log_probs(reference, "MKTAYIAKQR", client.alphabet()),
                                   atol=1e-4)
        np.testing.assert_allclose(each[1, k, :6], reference_log_probs(reference, "GVSE", client.alphabet()),
                                   atol=1e-4)
    plain = client.client.infer(f"{NAME}_logits", {"sequences": _column("GVSE")}, ["log_probs", "mask"])
    assert set(plain) == {"log_probs", "mask"}
    through_client, mask = client.member_log_probs(["MKTAYIAKQR", "GVSE"])  # the Python client's call
    assert np.array_equal(through_client, each) and mask.shape == (2, 12)


@pytest.mark.parametrize("method", ["wt-marginal", "masked-marginal"])
def test_served_scores_are_the_mean_of_each_members_scores(served, method):
    _, _, references, client, _ = served
    each = np.array([brute_force(reference, WILD_TYPE, VARIANTS, method) for reference in references])
    np.testing.assert_allclose(client.score_variants(WILD_TYPE, VARIANTS, method), each.mean(axis=0), atol=1e-4)
    asked = client.client.infer(f"{NAME}_scores", {
        "sequences": _column(WILD_TYPE), "variants": np.array([[v.encode() for v in VARIANTS]], dtype=np.object_),
        "method": _column(method)}, ["scores", "member_scores"])
    assert asked["member_scores"].shape == (1, 3, len(VARIANTS))
    np.testing.assert_allclose(asked["member_scores"][0], each, atol=1e-4)
    np.testing.assert_allclose(asked["scores"][0], each.mean(axis=0), atol=1e-4)
    np.testing.assert_allclose(client.member_scores(WILD_TYPE, VARIANTS, method), each, atol=1e-4)


def test_served_plls_are_the_mean_of_each_members_plls(served):
    _, _, references, client, _ = served
    sequences = ["MKTAYIAKQR", "GVSE"]
    each = np.array([[brute_force_pll(reference, s, client.alphabet()) for s in sequences]
                     for reference in references])
    np.testing.assert_allclose(client.pseudo_log_likelihood(sequences), each.mean(axis=0), atol=1e-4)
    asked = client.client.infer(f"{NAME}_scores", {"sequences": _column(*sequences)}, ["member_scores"])
    np.testing.assert_allclose(asked["member_scores"][:, :, 0], each.T, atol=1e-4)


def test_verify_checks_the_ensemble_against_its_members_and_wants_every_member(served):
    result, checkpoints, _, _, url = served
    checks = verify_repository(result.repository, checkpoints, url=url)
    assert checks and all(check.passed for check in checks), [c for c in checks if not c.passed]
    assert sum("member_log_probs of member" in check.note for check in checks) == 3
    with pytest.raises(InvalidInputError, match="was built from 3 checkpoints .*got 2: give `checkpoint` once per "
                                                "member"):
        verify_repository(result.repository, checkpoints[:2], url=url)
    swapped = verify_repository(result.repository, [checkpoints[1], checkpoints[0], checkpoints[2]], url=url)
    assert not all(check.passed for check in swapped)  # member 1's answers are not member 2's
