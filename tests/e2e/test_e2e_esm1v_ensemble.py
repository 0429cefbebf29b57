"""ESM-1v's use, served: fair-esm hub files of several seeds (tiny random ESM-1v models of fair-esm's
own classes, saved as `esm1v_t33_650M_UR90S_<n>.pt` are laid out: tests/unit/test_fair_esm.py)
built as one checkpoint ensemble, the family read from the files, and served by a real tritonserver.

The reference is fair-esm itself: each file loaded by fair-esm's own loader, its logits restricted to
the served alphabet and log-softmaxed, one member at a time, averaged here; the scores follow ESM's
predict.py formula on those models (tests/helpers/masked_lm_reference.py), averaged over the seeds
as ESM's users average the seeds' score columns.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

esm = pytest.importorskip("esm")  # fair-esm, the reference (requirements/runtime.txt)

from bionemo_export.build import BuildRequest, build_repository  # noqa: E402
from bionemo_export.client import RepositoryClient  # noqa: E402
from bionemo_export.runtime import TritonServer  # noqa: E402
from tests.helpers.masked_lm_reference import brute_force, reference_log_probs  # noqa: E402
from tests.unit.test_fair_esm import _esm1b_file, _reference  # noqa: E402

NAME = "esm1v"
SEEDS = (11, 12)
"""Two seeds of the five ESM-1v has: their mean is neither member, which is what an ensemble adds."""
WILD_TYPE = "MKTAYIAKQRQISFVKSHF"
VARIANTS = ["M1A", "K2R:T3S", "Y5W", "F19E:H18K"]


class FairEsm:
    """fair-esm's model called as transformers' EsmForMaskedLM is by the reference helpers:
    `(input_ids=..., attention_mask=...).logits` (one unpadded sequence)."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.model(input_ids)["logits"])


@pytest.fixture(scope="module")
def served(tmp_path_factory, triton_install):
    work = tmp_path_factory.mktemp("esm1v")
    files = [_esm1b_file(work, f"esm1v_t2_tiny_{n}", seed=seed)[0] for n, seed in enumerate(SEEDS, 1)]
    result = build_repository(BuildRequest(family=None, checkpoint=files[0], members=tuple(files[1:]), name=NAME,
                                           out=work / "repo", backend="python", optimize=False))
    references = [FairEsm(_reference(path)) for path in files]
    with TritonServer(work / "repo", install=triton_install, log_file=work / "tritonserver.log") as server:
        with RepositoryClient(NAME, f"grpc://{server.endpoints.grpc_url}") as client:
            yield result, references, client


def test_the_seeds_files_build_one_esm1_ensemble(served):
    result, _, _ = served
    manifest = result.manifest
    assert manifest.family == "esm1" and manifest.tasks == ["logits", "scores"]
    assert [m["checkpoint_form"] for m in manifest.members or []] == [
        f"fair-esm ESM-1v file esm1v_t2_tiny_{n}.pt" for n in range(1, len(SEEDS) + 1)]


def test_served_log_probs_are_the_mean_of_the_seeds_in_fair_esm(served):
    _, references, client = served
    for sequence in ("MKTAYIAKQR", "GV_EKTAY"):
        log_probs, _ = client.seqs_to_log_probs([sequence])
        each = [reference_log_probs(reference, sequence, client.alphabet()) for reference in references]
        np.testing.assert_allclose(log_probs[0, :len(sequence) + 2], np.mean(each, axis=0), atol=1e-4)


@pytest.mark.parametrize("method", ["wt-marginal", "masked-marginal"])
def test_served_scores_are_the_mean_of_the_seeds_scores_in_fair_esm(served, method):
    _, references, client = served
    each = np.array([brute_force(reference, WILD_TYPE, VARIANTS, method) for reference in references])
    asked = client.client.infer(f"{NAME}_scores", {
        "sequences": np.array([[WILD_TYPE.encode()]], dtype=np.object_),
        "variants": np.array([[v.encode() for v in VARIANTS]], dtype=np.object_),
        "method": np.array([[method.encode()]], dtype=np.object_)}, ["scores", "member_scores"])
    np.testing.assert_allclose(asked["scores"][0], each.mean(axis=0), atol=1e-4)
    np.testing.assert_allclose(asked["member_scores"][0], each, atol=1e-4)
