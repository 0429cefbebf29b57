"""ESM C served by a real tritonserver: a random EsmcForMaskedLM (64-wide heads, every parameter
perturbed off its initial value) built as a repository; embeddings, hiddens, log-probabilities and
variant scores equal transformers' own EsmcForMaskedLM within 1e-4 (scores: ESM's predict.py
formula, brute force, tests/helpers/masked_lm_reference.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.client import RepositoryClient
from bionemo_export.runtime import TritonServer
from tests.helpers.masked_lm_reference import brute_force, reference_log_probs
from tests.helpers.random_models import esmc_checkpoint

NAME = "esmc"
SEQUENCES = ["MKTAYIAKQR", "MSLKRKNIALIPAAGIGVRFG", "LAGVSERTIDPKQNFYMHWCXBUZO"]
WILD_TYPE = "MKTAYIAKQRQISFVKSHFSRQ"
VARIANTS = ["M1A", "K2R:T3S", "Y5W", "Q22E:R21K:S20T"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, triton_install):
    work = tmp_path_factory.mktemp("esmc")
    _, reference = esmc_checkpoint(work / "checkpoint")
    result = build_repository(BuildRequest(family="esmc", checkpoint=work / "checkpoint", name=NAME,
                                           out=work / "repo", backend="python", optimize=False))
    with TritonServer(work / "repo", install=triton_install, log_file=work / "tritonserver.log") as server:
        with RepositoryClient(NAME, f"grpc://{server.endpoints.grpc_url}") as client:
            yield result, reference, client


def _transformers(reference, sequences: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    tokenizer = transformers.EsmcTokenizer()
    inputs = tokenizer(sequences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hiddens = reference.esmc(**inputs).last_hidden_state
    return hiddens, inputs["attention_mask"]


def test_served_embeddings_and_hiddens_equal_transformers(served):
    result, reference, client = served
    assert {f"{NAME}_embeddings", f"{NAME}_hiddens", f"{NAME}_logits", f"{NAME}_scores"} <= set(result.models)
    expected, attention = _transformers(reference, SEQUENCES)
    hiddens, mask = client.seqs_to_hidden(SEQUENCES)
    embeddings = client.seqs_to_embedding(SEQUENCES)
    for row, sequence in enumerate(SEQUENCES):
        tokens = len(sequence) + 2
        np.testing.assert_allclose(hiddens[row, :tokens], expected[row, :tokens], atol=1e-4)
        residues = expected[row, 1:1 + len(sequence)]
        np.testing.assert_allclose(embeddings[row], residues.mean(0), atol=1e-4)
        assert mask[row].tolist()[:tokens] == [False] + [True] * len(sequence) + [False]
    assert attention.sum().item() == sum(len(s) + 2 for s in SEQUENCES)


def test_served_log_probs_and_scores_equal_transformers(served):
    _, reference, client = served
    sequences = ["MKTAYIAKQR", "GV_E"]
    log_probs, _ = client.seqs_to_log_probs(sequences)
    for row, sequence in enumerate(sequences):
        expected = reference_log_probs(reference, sequence, client.alphabet())
        np.testing.assert_allclose(log_probs[row, :len(sequence) + 2], expected, atol=1e-4)
    for method in ("wt-marginal", "masked-marginal"):
        scores = client.score_variants(WILD_TYPE, VARIANTS, method)
        np.testing.assert_allclose(scores, brute_force(reference, WILD_TYPE, VARIANTS, method), atol=1e-4)
