"""MegaMolBART end to end: the small trained copy model (tests/data), built, served by the real tritonserver.

Checks the four public models against the PyTorch reference: embeddings/hiddens numerically,
decodes string for string against the reference greedy decode (no cache, PyTorch), the
SMILES -> hiddens -> SMILES round trip, and samplings (shapes for every method, seeded
reproducibility, equality with the seeded reference).
"""

from __future__ import annotations

import numpy as np
import pytest

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.client import InferenceError, Seq2SeqClient, TritonClient, strings_to_tensor
from bionemo_export.generation.reference import encode_hiddens, reference_decode, reference_sample
from bionemo_export.kits.decoding import SAMPLING_CHECKS, expected_outputs
from bionemo_export.model_repository.encoder import ServingOptions
from bionemo_export.models import get_family
from bionemo_export.runtime import TritonServer
from bionemo_export.serving.tokenizers.smiles import tokenize
from bionemo_export.verify import verify_repository

NAME = "megamolbart"
MAX_DECODE = None  # the model's own limit


@pytest.fixture(scope="module")
def trained(trained_megamolbart):
    """(checkpoint, training SMILES, held-out SMILES) of a small model trained to auto-encode."""
    from bionemo_export.models.megamolbart_training import generate_smiles, training_smiles

    checkpoint = trained_megamolbart
    training = training_smiles()
    tokenizer = get_family("megamolbart").load(checkpoint).tokenizer
    seen = set(training)
    held_out = []
    for smiles in generate_smiles(len(training) + 100, seed=0):
        if smiles not in seen and all(t in tokenizer.vocab for t in tokenize(smiles)):
            held_out.append(smiles)
    return checkpoint, training, held_out[:20]


@pytest.fixture(scope="module")
def served(trained, tmp_path_factory, triton_install):
    checkpoint, _, _ = trained
    work = tmp_path_factory.mktemp("repo")
    build_repository(BuildRequest(
        family="megamolbart", checkpoint=checkpoint, name=NAME, out=work / "repo", backend="python",
        max_decode_length=MAX_DECODE,
        serving=ServingOptions(max_batch_size=32, max_queue_delay_microseconds=0), optimize=False,
    ))
    loaded = get_family("megamolbart").load(checkpoint)
    with TritonServer(work / "repo", install=triton_install, log_file=work / "server.log") as server:
        yield loaded, server


def _client(server, protocol="grpc") -> Seq2SeqClient:
    address = server.endpoints.grpc_url if protocol == "grpc" else server.endpoints.http_url
    return Seq2SeqClient(NAME, f"{protocol}://{address}")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_embeddings_and_hiddens_match_pytorch(served, trained, protocol):
    loaded, server = served
    batch = trained[1][:5]
    ref_hiddens, ref_mask = encode_hiddens(loaded, batch)
    with _client(server, protocol) as client:
        hiddens, mask = client.seqs_to_hidden(batch)
        embeddings = client.seqs_to_embedding(batch)
    np.testing.assert_array_equal(mask, ref_mask)
    assert np.abs(hiddens - ref_hiddens)[ref_mask].max() <= 1e-4
    pooled = (ref_hiddens * ref_mask[..., None]).sum(1) / ref_mask.sum(1, keepdims=True)
    assert np.abs(embeddings - pooled).max() <= 1e-4


def test_served_decodes_equal_the_reference_greedy_decode(served, trained):
    loaded, server = served
    _, training, held_out = trained
    test_set = training[:12] + held_out[:12] + get_family("megamolbart").sample_sequences()
    hiddens, mask = encode_hiddens(loaded, test_set)
    expected = reference_decode(loaded, hiddens, mask, MAX_DECODE)
    with _client(server) as client:
        served_strings = client.hidden_to_seqs(hiddens, mask)
    assert served_strings == expected  # 100% of the test set, string for string


def test_smiles_round_trip_through_hiddens_and_decodes(served, trained):
    """The trained model reconstructs SMILES from their served hidden states: the generated
    molecules it was trained on, and unseen ones of the same kind."""
    _, server = served
    _, training, held_out = trained
    seen = training[-16:]
    with _client(server) as client:
        decoded = client.hidden_to_seqs(*client.seqs_to_hidden(seen))
        held_decoded = client.hidden_to_seqs(*client.seqs_to_hidden(held_out[:16]))
    assert sum(a == b for a, b in zip(decoded, seen)) >= 15, list(zip(seen, decoded))
    assert sum(a == b for a, b in zip(held_decoded, held_out[:16])) >= 12, list(zip(held_out, held_decoded))


@pytest.mark.parametrize(("method", "parameters"), SAMPLING_CHECKS)
def test_every_sampling_method_has_the_right_shape_and_is_reproducible(served, trained, method, parameters):
    loaded, server = served
    batch = trained[2][:3]
    with _client(server) as client:
        first = client.sample_seqs(batch, sampling_method=method, seed=7, **parameters)
        again = client.sample_seqs(batch, sampling_method=method, seed=7, **parameters)
    assert [len(row) for row in first] == [expected_outputs(method, parameters)] * len(batch)
    assert first == again
    assert first == reference_sample(loaded, batch, seed=7, method=method, max_length=MAX_DECODE, **parameters)


def test_default_sampling_is_one_greedy_perturbed_sample_and_radius_zero_decodes(served, trained):
    loaded, server = served
    batch = trained[1][:4]
    with _client(server) as client:
        default = client.sample_seqs(batch)
        exact = client.sample_seqs(batch, scaled_radius=0.0)
    assert [len(row) for row in default] == [1] * 4
    # No noise: sampling is the plain greedy decode of the sequence itself.
    assert [row[0] for row in exact] == batch


def test_bad_decode_and_sampling_inputs_fail_alone(served, trained):
    loaded, server = served
    width = loaded.hidden_size
    with TritonClient(f"grpc://{server.endpoints.grpc_url}") as client:
        hiddens = np.zeros((1, 4, width), dtype=np.float32)
        hiddens[0, 1, 3] = np.nan
        with pytest.raises(InferenceError, match="(?i)nan|finite"):
            client.infer(f"{NAME}_decodes", {"hiddens": hiddens, "mask": np.ones((1, 4), dtype=bool)})
        with pytest.raises(InferenceError, match="mask"):
            client.infer(f"{NAME}_decodes", {"hiddens": np.zeros((1, 4, width), np.float32),
                                             "mask": np.ones((1, 5), dtype=bool)})
        with pytest.raises(InferenceError, match="unknown sampling method"):
            client.infer(f"{NAME}_samplings", {"sequences": strings_to_tensor(["CCO"]),
                                               "sampling_method": strings_to_tensor(["no-such-method"])})
        with pytest.raises(InferenceError, match="not in the vocabulary"):
            client.infer(f"{NAME}_samplings", {"sequences": strings_to_tensor(["CCO\u00e9"])})
    with _client(server) as client:
        assert client.sample_seqs(["CCO"], scaled_radius=0.0) == [["CCO"]]


def test_verify_covers_decodes_and_samplings(served, trained):
    _, server = served
    checks = verify_repository(server.model_repository, trained[0], url=f"grpc://{server.endpoints.grpc_url}")
    assert {check.model for check in checks} == {f"{NAME}_{task}" for task in
                                                 ("embeddings", "hiddens", "decodes", "samplings", "layers")}
    failed = [check for check in checks if not check.passed]
    assert not failed, failed
