"""Proteins longer than the model's window, served (build --max-residues): a tiny random ESM-2
built with a 22-token limit (windows of 20 residues) serving up to 100 residues. The served
hiddens, embeddings and log-probabilities of a 57-residue protein equal the documented merge rule
(serving/windows.py) applied, with plain loops (tests/helpers/window_reference.py), to
transformers' own EsmForMaskedLM run on each window; within the window nothing changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from bionemo_export.build import BuildError, BuildRequest, build_repository
from bionemo_export.client import InferenceError, RepositoryClient
from bionemo_export.model_repository.options import ServingOptions
from bionemo_export.runtime import TritonServer
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.helpers.masked_lm_reference import ESM_VOCAB
from tests.helpers.window_reference import brute_merge

NAME = "win"
WINDOW, OVERLAP, MAX_RESIDUES = 20, 6, 100
LONG = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQF"[:57]


@pytest.fixture(scope="module")
def served(tmp_path_factory, triton_install):
    work = tmp_path_factory.mktemp("windows")
    checkpoint = save_random_checkpoint("esm2", work / "checkpoint", seed=0)
    build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name=NAME, out=work / "repo",
                                  backend="python", max_length=WINDOW + 2, tasks=("embeddings", "hiddens", "logits"),
                                  serving=ServingOptions(max_residues=MAX_RESIDUES, window_overlap=OVERLAP),
                                  optimize=False))
    reference = transformers.EsmForMaskedLM.from_pretrained(checkpoint).eval()
    with TritonServer(work / "repo", install=triton_install, log_file=work / "tritonserver.log") as server:
        with RepositoryClient(NAME, f"grpc://{server.endpoints.grpc_url}") as client:
            yield client, reference


def _windows(n: int) -> list[tuple[int, int]]:
    """The documented plan: the fewest full windows overlapping by at least OVERLAP, spread evenly."""
    count = 1 + -(-(n - WINDOW) // (WINDOW - OVERLAP))
    return [(i * (n - WINDOW) // (count - 1), i * (n - WINDOW) // (count - 1) + WINDOW) for i in range(count)]


def _reference(reference, sequence: str, alphabet: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(hiddens, log_probs) over <cls> + residues + <eos>: each window alone in transformers, merged."""
    spans = _windows(len(sequence))
    hiddens, log_probs = [], []
    columns = [ESM_VOCAB.index(a) for a in alphabet]
    for start, end in spans:
        ids = torch.tensor([[0, *(ESM_VOCAB.index(c) for c in sequence[start:end]), 2]])
        with torch.no_grad():
            out = reference(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
        hiddens.append(out.hidden_states[-1][0].numpy())
        log_probs.append(torch.log_softmax(out.logits[0][:, columns], dim=-1).numpy())
    return brute_merge(hiddens, spans, True, True), brute_merge(log_probs, spans, True, True)


def test_a_long_protein_is_served_by_the_documented_merge_of_its_windows(served):
    client, reference = served
    hiddens, mask = client.seqs_to_hidden([LONG, "MKTAY"])
    expected_hiddens, expected_log_probs = _reference(reference, LONG, client.alphabet())
    assert hiddens.shape == (2, len(LONG) + 2, 32)
    assert mask[0].tolist() == [False] + [True] * len(LONG) + [False]
    np.testing.assert_allclose(hiddens[0], expected_hiddens, atol=1e-4)
    embeddings = client.seqs_to_embedding([LONG])
    np.testing.assert_allclose(embeddings[0], expected_hiddens[1:-1].mean(axis=0), atol=1e-4)
    log_probs, _ = client.seqs_to_log_probs([LONG])
    np.testing.assert_allclose(log_probs[0], expected_log_probs, atol=1e-4)


def test_a_protein_within_the_window_is_one_pass(served):
    client, reference = served
    short = LONG[:WINDOW]
    hiddens, mask = client.seqs_to_hidden([short])
    ids = torch.tensor([[0, *(ESM_VOCAB.index(c) for c in short), 2]])
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=torch.ones_like(ids),
                             output_hidden_states=True).hidden_states[-1][0].numpy()
    np.testing.assert_allclose(hiddens[0], expected, atol=1e-4)


def test_over_the_stated_maximum_is_the_requests_error_naming_length_and_limit(served):
    client, _ = served
    with pytest.raises(InferenceError, match="sequence of 101 residues is longer than the maximum of 100"):
        client.seqs_to_embedding(["M" * 101])
    assert client.seqs_to_embedding(["MKTAY"]).shape == (1, 32)  # the server carries on


def test_windows_need_the_fused_layout(tmp_path):
    checkpoint = save_random_checkpoint("esm2", tmp_path / "checkpoint", seed=1)
    with pytest.raises(BuildError, match="`max_residues` .* use `backend` python"):
        build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="x", out=tmp_path / "repo",
                                      backend="native", serving=ServingOptions(max_residues=100), optimize=False))
