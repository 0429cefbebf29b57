"""Encoder repositories end to end: build, serve with the real tritonserver, compare with PyTorch.

One repository and one server per family (tiny random ESM-2; the real pretrained AntiBERTy),
queried over HTTP and gRPC like a plain tritonclient user would.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from typer.testing import CliRunner

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.cli.main import app
from bionemo_export.client import EncoderClient, InferenceError, TritonClient, strings_to_tensor
from bionemo_export.model_repository.encoder import ServingOptions
from bionemo_export.model_repository.manifest import Manifest
from bionemo_export.models import get_family
from bionemo_export.models.bert import antiberty_checkpoint
from bionemo_export.runtime import TritonServer
from bionemo_export.serving.numerics import cosine_rows
from bionemo_export.testing.checkpoints import save_random_checkpoint
from bionemo_export.verify import verify_repository

ATOL = 1e-4
MAX_BATCH = 8


@pytest.fixture(scope="module", params=["esm2", "bert"])
def served(request, tmp_path_factory, triton_install):
    """(family, loaded reference model, server, repository name) for a freshly built repository."""
    family = get_family(request.param)
    work = tmp_path_factory.mktemp(request.param)
    if request.param == "bert":
        checkpoint = antiberty_checkpoint()  # real pretrained weights from the antiberty wheel
    else:
        checkpoint = save_random_checkpoint(family.name, work / "checkpoint", seed=0)
    name = f"{request.param}test"
    build_repository(BuildRequest(
        family=request.param, checkpoint=checkpoint, name=name, out=work / "repo", backend="python",
        serving=ServingOptions(max_batch_size=MAX_BATCH, max_queue_delay_microseconds=0, response_cache=True),
        optimize=False,
    ))
    loaded = family.load(checkpoint)
    with TritonServer(work / "repo", install=triton_install, log_file=work / "server.log",
                      response_cache_bytes=16 << 20) as server:
        yield family, loaded, server, name, checkpoint


def _reference(loaded, sequences):
    encoded = loaded.tokenizer.encode(sequences)
    with torch.no_grad():
        hiddens, embeddings = loaded.encoder(*(torch.from_numpy(a) for a in
                                               (encoded.input_ids, encoded.attention_mask, encoded.residue_mask)))
    return hiddens.numpy(), embeddings.numpy(), encoded


def _mixed_batch(family) -> list[str]:
    samples = sorted(family.sample_sequences(), key=len)
    return [samples[-1], samples[0], samples[len(samples) // 2]]  # long, short, medium: real padding


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_embeddings_and_hiddens_match_pytorch(served, protocol):
    family, loaded, server, name, _ = served
    url = f"{protocol}://" + (server.endpoints.http_url if protocol == "http" else server.endpoints.grpc_url)
    batch = _mixed_batch(family)
    ref_hiddens, ref_embeddings, encoded = _reference(loaded, batch)
    with EncoderClient(name, url) as client:
        embeddings = client.seqs_to_embedding(batch)
        hiddens, mask = client.seqs_to_hidden(batch)
    assert embeddings.shape == (3, loaded.hidden_size) and embeddings.dtype == np.float32
    assert np.abs(embeddings - ref_embeddings).max() <= ATOL
    assert cosine_rows(embeddings, ref_embeddings).min() > 0.9999
    assert hiddens.shape == ref_hiddens.shape and mask.dtype == np.bool_
    real = encoded.attention_mask.astype(bool)
    assert np.abs(hiddens - ref_hiddens)[real].max() <= ATOL
    # mask is True exactly on residues: never on BOS/EOS or padding.
    for row, sequence in enumerate(batch):
        assert mask[row].sum() == len(sequence)
        assert not mask[row, 0] and mask[row, 1 : 1 + len(sequence)].all()
    # embeddings are the mean of hiddens over mask.
    pooled = (hiddens * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    np.testing.assert_allclose(pooled, embeddings, atol=1e-5)


def test_batched_requests_give_the_same_answers_as_single_requests(served):
    family, _, server, name, _ = served
    batch = _mixed_batch(family)
    with EncoderClient(name, f"grpc://{server.endpoints.grpc_url}") as client:
        together = client.seqs_to_embedding(batch)
        hiddens, mask = client.seqs_to_hidden(batch)
        for row, sequence in enumerate(batch):
            alone = client.seqs_to_embedding([sequence])
            np.testing.assert_allclose(alone[0], together[row], atol=1e-5)
            single_hiddens, single_mask = client.seqs_to_hidden([sequence])
            length = single_mask.shape[1]
            np.testing.assert_array_equal(single_mask[0], mask[row, :length])
            np.testing.assert_allclose(single_hiddens[0], hiddens[row, :length], atol=1e-5)


def test_a_plain_tritonclient_request_works(served):
    """What docs/clients.md tells a user to write, with nothing from bionemo_export."""
    _, loaded, server, name, _ = served
    client = grpcclient.InferenceServerClient(server.endpoints.grpc_url)
    sequences = np.array([[b"MKTAYIAKQRQISFVKSHFSRQ"]], dtype=np.object_)
    inp = grpcclient.InferInput("sequences", [1, 1], "BYTES")
    inp.set_data_from_numpy(sequences)
    result = client.infer(f"{name}_embeddings", [inp])
    assert result is not None
    embeddings = result.as_numpy("embeddings")
    assert embeddings is not None and embeddings.shape == (1, loaded.hidden_size)
    client.close()


@pytest.mark.parametrize(
    ("sequences", "message"),
    [
        (["MKTAYJAK"], "invalid character 'J' at position 5"),
        ([""], "empty"),
        (["MKT", "MK1"], "sequence 1"),
    ],
)
def test_bad_sequences_fail_only_their_request(served, sequences, message):
    family, _, server, name, _ = served
    with TritonClient(f"grpc://{server.endpoints.grpc_url}") as client:
        with pytest.raises(InferenceError, match=message):
            client.infer(f"{name}_embeddings", {"sequences": strings_to_tensor(sequences)})
        ok = client.infer(f"{name}_embeddings", {"sequences": strings_to_tensor(["MKTAYIAK"])})
    assert np.isfinite(ok["embeddings"]).all()


def test_too_long_non_utf8_and_oversized_batches_are_refused(served):
    family, loaded, server, name, _ = served
    too_long = "A" * loaded.tokenizer.max_length
    with TritonClient(f"http://{server.endpoints.http_url}") as client:
        with pytest.raises(InferenceError, match="residues; the maximum is"):
            client.infer(f"{name}_embeddings", {"sequences": strings_to_tensor([too_long])})
        with pytest.raises(InferenceError, match="UTF-8"):
            client.infer(f"{name}_embeddings", {"sequences": np.array([[b"MK\xff\xfeA"]], dtype=np.object_)})
        with pytest.raises(InferenceError, match="batch"):
            client.infer(f"{name}_embeddings", {"sequences": strings_to_tensor(["MKT"] * (MAX_BATCH + 1))})
        assert client.infer(f"{name}_hiddens", {"sequences": strings_to_tensor(["MKT"])})["mask"].sum() == 3


def test_verify_against_the_running_server_passes(served):
    _, _, server, name, checkpoint = served
    repository = server.model_repository
    manifest = Manifest.read(repository)
    assert manifest.family in ("esm2", "bert") and manifest.name == name
    assert manifest.verification["passed"]
    checks = verify_repository(repository, checkpoint, url=f"grpc://{server.endpoints.grpc_url}")
    assert checks and all(check.passed for check in checks)
    # Random ESM-2 and BERT checkpoints are *ForMaskedLM: their log-probabilities and scores are checked too,
    # and the default tasks' layers and attentions (and ESM-2's contacts: its checkpoint carries the head).
    tasks = ["embeddings", "hiddens", "logits", "scores", "layers", "attentions"]
    tasks += ["contacts"] if manifest.family == "esm2" else []
    assert {check.model for check in checks} == {f"{name}_{task}" for task in tasks}


def test_verify_cli_passes_for_the_checkpoint_and_fails_for_another(served, tmp_path):
    family, _, server, name, checkpoint = served
    runner = CliRunner()
    url = f"grpc://{server.endpoints.grpc_url}"
    repository = str(server.model_repository)
    passed = runner.invoke(app, ["verify", repository, "--checkpoint", str(checkpoint), "--url", url],
                           env={"COLUMNS": "200"})
    assert passed.exit_code == 0, passed.output
    assert "all checks passed" in passed.output and f"{name}_hiddens" in passed.output
    other = save_random_checkpoint(family.name, tmp_path / "other", seed=7)
    failed = runner.invoke(app, ["verify", repository, "--checkpoint", str(other), "--url", url],
                           env={"COLUMNS": "200"})
    assert failed.exit_code == 1, failed.output
    assert "differ from PyTorch" in failed.output


def test_client_encode_cli_writes_bionemo_style_json(served, tmp_path):
    _, loaded, server, name, _ = served
    out = tmp_path / "hiddens.json"
    result = CliRunner().invoke(app, ["client", "encode", "--model", f"{name}_hiddens", "-s", "MKTAYIAK",
                                      "-s", "MKT", "--triton-url", f"grpc://{server.endpoints.grpc_url}",
                                      "--output", str(out)])
    assert result.exit_code == 0, result.output
    written = json.loads(out.read_text())
    assert set(written) == {"hiddens", "mask"}
    assert np.array(written["hiddens"]).shape == (2, 10, loaded.hidden_size)
    assert np.array(written["mask"]).sum(axis=1).tolist() == [8, 3]


def test_repeated_requests_are_served_from_the_response_cache(served):
    _, _, server, name, _ = served
    model = f"{name}_embeddings"
    sequences = strings_to_tensor(["MKTAYIAKQRQISFVKSHFSRQLEE"])
    with TritonClient(f"grpc://{server.endpoints.grpc_url}") as client:
        first = client.infer(model, {"sequences": sequences})["embeddings"]
        second = client.infer(model, {"sequences": sequences})["embeddings"]
    np.testing.assert_array_equal(first, second)
    answer = grpcclient.InferenceServerClient(server.endpoints.grpc_url).get_inference_statistics(model, as_json=True)
    assert isinstance(answer, dict), answer  # as_json: parsed JSON, not a protobuf
    stats = answer["model_stats"][0]["inference_stats"]
    assert int(stats["cache_hit"]["count"]) >= 1
