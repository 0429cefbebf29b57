"""SaProt served by a real tritonserver: a random SaProt directory (EsmForMaskedLM over SaProt's 446
paired tokens, every parameter moved off its initial value) built as a repository without naming
the family; embeddings, hiddens and per-residue log-probabilities equal transformers' own
EsmForMaskedLM driven with token ids read from vocab.txt directly (within 1e-4); scores equal
SaProt's predict_mut computed here from transformers' logits (tests/helpers/saprot_reference.py),
through the Python client and `client score`; bad input is INVALID_ARGUMENT to that request alone."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.client import RepositoryClient
from bionemo_export.runtime import TritonServer
from tests.helpers.random_models import saprot_checkpoint
from tests.helpers.saprot_reference import (
    AMINO_ACIDS,
    marginal_scores,
    pairs,
    predict_mut,
    residue_log_probs,
    token_ids,
    vocab_ids,
)

NAME = "saprot"
SEQUENCES = ["MdEvVpLgKaTy", "MSLKRKNIALIPAAGIGVRFG", "M#K#T#A#"]
PLAIN = [False, True, False]
WILD_TYPE = "MdKvTpAyYnIwArKqQhRgQdIlSvFtVmKfSsHaFeSiRkQc"
VARIANTS = ["M1A", "K2R:T3S", "Y5W", "Q22E:R21K:S20T"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, triton_install):
    work = tmp_path_factory.mktemp("saprot")
    _, reference = saprot_checkpoint(work / "checkpoint")
    result = build_repository(BuildRequest(family=None, checkpoint=work / "checkpoint", name=NAME,
                                           out=work / "repo", backend="python", optimize=False))
    with TritonServer(work / "repo", install=triton_install, log_file=work / "tritonserver.log") as server:
        with RepositoryClient(NAME, f"grpc://{server.endpoints.grpc_url}") as client:
            yield result, reference, vocab_ids(work / "checkpoint"), client, server, work


def test_served_embeddings_hiddens_and_log_probs_equal_transformers(served):
    result, reference, vocab, client, _, _ = served
    assert {f"{NAME}_embeddings", f"{NAME}_hiddens", f"{NAME}_logits", f"{NAME}_scores"} <= set(result.models)
    assert client.alphabet() == tuple(AMINO_ACIDS)
    hiddens, mask = client.seqs_to_hidden(SEQUENCES)
    embeddings = client.seqs_to_embedding(SEQUENCES)
    log_probs, logits_mask = client.seqs_to_log_probs(SEQUENCES)
    for row, (sequence, plain) in enumerate(zip(SEQUENCES, PLAIN)):
        tokens = pairs(sequence, plain=plain)
        ids = token_ids(vocab, tokens)
        with torch.no_grad():
            expected = reference(input_ids=ids, output_hidden_states=True).hidden_states[-1][0].numpy()
        width = len(tokens) + 2
        np.testing.assert_allclose(hiddens[row, :width], expected, atol=1e-4)
        np.testing.assert_allclose(embeddings[row], expected[1:-1].mean(0), atol=1e-4)
        assert mask[row].tolist()[:width] == [False] + [True] * len(tokens) + [False]
        assert logits_mask[row].tolist()[:width] == mask[row].tolist()[:width]
        np.testing.assert_allclose(log_probs[row, :width], residue_log_probs(reference, vocab, tokens), atol=1e-4)


def test_served_scores_are_saprots_predict_mut(served):
    _, reference, vocab, client, _, _ = served
    expected = [predict_mut(reference, vocab, pairs(WILD_TYPE), variant) for variant in VARIANTS]
    assert np.ptp(expected) > 0.5
    np.testing.assert_allclose(client.score_variants(WILD_TYPE, VARIANTS), expected, atol=1e-4)  # the default
    np.testing.assert_allclose(client.score_variants(WILD_TYPE, VARIANTS, "variant-masked"), expected, atol=1e-4)
    np.testing.assert_allclose(client.score_variants(WILD_TYPE, VARIANTS, "wt-marginal"),
                               marginal_scores(reference, vocab, pairs(WILD_TYPE), VARIANTS, "wt-marginal"), atol=1e-4)
    plain = WILD_TYPE[0::2]
    np.testing.assert_allclose(client.score_variants(plain, VARIANTS),
                               [predict_mut(reference, vocab, pairs(plain, plain=True), v) for v in VARIANTS],
                               atol=1e-4)


def test_client_score_reads_structure_aware_wild_types(served, tmp_path):
    from typer.testing import CliRunner

    from bionemo_export.cli.main import app

    _, reference, vocab, client, _, _ = served
    (tmp_path / "wt.fasta").write_text(f">wt\n{WILD_TYPE}\n")
    with (tmp_path / "dms.csv").open("w", newline="") as handle:
        csv.writer(handle).writerows([["mutant", "DMS_score"], *[[v, str(i)] for i, v in enumerate(VARIANTS)]])
    command = ["client", "score", "-m", f"{NAME}_scores", "--fasta", str(tmp_path / "wt.fasta"),
               "--variants", str(tmp_path / "dms.csv"), "--triton-url", str(client.client.url)]
    result = CliRunner().invoke(app, [*command, "--output", str(tmp_path / "scored.csv")])
    assert result.exit_code == 0, result.output
    assert f"wrote {len(VARIANTS)} scores (variant-masked)" in result.output
    written = list(csv.DictReader((tmp_path / "scored.csv").open(newline="")))
    np.testing.assert_allclose([float(r["variant-masked_score"]) for r in written],
                               [predict_mut(reference, vocab, pairs(WILD_TYPE), v) for v in VARIANTS], atol=1e-4)

    (tmp_path / "bad.fasta").write_text(f">wt\n{WILD_TYPE[:-1]}\n")
    bad = CliRunner().invoke(app, ["client", "score", "-m", f"{NAME}_scores", "--fasta", str(tmp_path / "bad.fasta"),
                                   "--variants", str(tmp_path / "dms.csv"), "--triton-url", str(client.client.url),
                                   "--output", str(tmp_path / "bad.csv")])
    assert bad.exit_code != 0
    assert "has an odd length, 43 characters" in " ".join(bad.output.split()), bad.output


def _refused(server, model: str, inputs: dict[str, np.ndarray]) -> str:
    """The message of the error `model` answers `inputs` with (plain tritonclient), checked to be
    INVALID_ARGUMENT."""
    client = grpcclient.InferenceServerClient(server.endpoints.grpc_url)
    try:
        tensors = []
        for name, array in inputs.items():
            tensor = grpcclient.InferInput(name, list(array.shape), "BYTES")
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        with pytest.raises(InferenceServerException) as caught:
            client.infer(model, tensors)
    finally:
        client.close()
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT", (caught.value.status(), caught.value.message())
    return str(caught.value.message())


def _bytes(*rows: list[str]) -> np.ndarray:
    return np.array([[item.encode() for item in row] for row in rows], dtype=np.object_)


@pytest.mark.parametrize("wild_type, variants, message", [
    ("MdEvV", ["M1A"], "input sequences: the wild type 'MdEvV' is structure-aware (it holds lowercase 3Di letters) "
                       "but has an odd length, 5 characters"),
    ("mdEv", ["E2A"], "the wild type 'mdEv' has 'm' at character 0 (residue 1), which is not one of SaProt's "
                      "residues; a residue is an uppercase letter"),
    ("MdEz", ["M1A"], "the wild type 'MdEz' has 'z' at character 3 (residue 2's structure letter), which is not a "
                      "Foldseek 3Di letter"),
    ("MdEv", ["E1A"], "variants[0] = 'E1A': position 1 is M in the wild type, not E"),
])
def test_bad_input_is_invalid_argument_and_the_server_carries_on(served, wild_type, variants, message):
    _, _, _, client, server, _ = served
    assert message in _refused(server, f"{NAME}_scores", {"sequences": _bytes([wild_type]),
                                                          "variants": _bytes(variants)})
    assert "has 'z' at character 3" in _refused(server, f"{NAME}_embeddings", {"sequences": _bytes(["MdEz"])})
    assert client.score_variants(WILD_TYPE, ["M1A"]).shape == (1,)
    assert client.seqs_to_embedding(["MdEv"]).shape == (1, 64)


def test_verify_passes_for_its_checkpoint_and_fails_for_another(served, tmp_path):
    """`verify` (served answers against PyTorch: hiddens, log-probabilities, scores and PLLs, its
    masked copies written with SaProt's `#`) passes for the checkpoint built and fails for another."""
    from bionemo_export.testing.checkpoints import save_random_checkpoint
    from bionemo_export.verify import verify_repository

    _, _, _, _, server, work = served
    url = f"grpc://{server.endpoints.grpc_url}"
    checks = verify_repository(work / "repo", work / "checkpoint", url=url)
    assert {f"{NAME}_logits", f"{NAME}_scores"} <= {check.model for check in checks}
    assert all(check.passed for check in checks), [c for c in checks if not c.passed]
    other = save_random_checkpoint("saprot", tmp_path / "other", seed=3)
    assert not all(check.passed for check in verify_repository(work / "repo", other, url=url))
