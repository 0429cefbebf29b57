"""`bionemo-export dev-server` (PyTriton, PyTorch inside) against a generated repository served by
the real tritonserver, from the same MegaMolBART checkpoint (tiny, random).

Both bind the same public models and tensors and give the same answers: embeddings and hidden
states within the family's tolerance, decodes and seeded samples equal. Every client works with
both: the Python client, PyTriton's ModelClient, the `client encode -> JSON -> client decode`
round trip, `client sample`, and `verify`. benchmarks/serving.py's baseline is this dev server
(test_e2e_masked_lm.py starts it the way that script does).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from typer.testing import CliRunner

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.cli.main import app
from bionemo_export.client import InferenceError, RepositoryClient
from bionemo_export.client.files import read_hiddens
from bionemo_export.generation.reference import encode_hiddens, reference_decode, reference_sample
from bionemo_export.kits.decoding import SAMPLING_CHECKS, expected_outputs
from bionemo_export.model_repository.options import ServingOptions
from bionemo_export.models import get_family
from bionemo_export.runtime import TritonServer
from bionemo_export.runtime.server import dying_with_parent, free_ports
from bionemo_export.testing.checkpoints import save_random_checkpoint
from bionemo_export.verify import verify_repository
from tests.helpers.cli import CLI

NAME = "mmb"
MAX_DECODE = 12
TASKS = ("embeddings", "hiddens", "decodes", "samplings")
runner = CliRunner()
WIDE = {"COLUMNS": "1000"}


def start_dev_server(command: list[str], log: Path, grpc_port: int, models: list[str]) -> subprocess.Popen:
    """A dev server process (its own process group, ended with its parent) once `models` are ready."""
    process = subprocess.Popen(dying_with_parent(command), stdout=log.open("w"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the dev server exited:\n{log.read_text()[-3000:]}")
        try:
            if all(client.is_model_ready(model) for model in models):
                return process
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        time.sleep(1)
    stop_dev_server(process)
    raise RuntimeError(f"the dev server did not become ready:\n{log.read_text()[-3000:]}")


def stop_dev_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)  # the dev server stops its tritonserver itself
    try:
        process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="module")
def servers(tmp_path_factory, triton_install):
    """{"repository": url prefix, "dev": url prefix} plus the checkpoint, loaded model and repository."""
    work = tmp_path_factory.mktemp("dev-server")
    family = get_family("megamolbart")
    checkpoint = save_random_checkpoint(family.name, work / "checkpoint", seed=5)
    # The tasks the dev server serves (a default build adds layers, which it does not).
    build_repository(BuildRequest(family="megamolbart", checkpoint=checkpoint, name=NAME, out=work / "repo",
                                  backend="python", tasks=TASKS, max_decode_length=MAX_DECODE,
                                  serving=ServingOptions(max_batch_size=16), optimize=False))
    http, grpc, metrics = free_ports(3)
    dev = start_dev_server([*CLI, "dev-server", "--model", "megamolbart", "--checkpoint", str(checkpoint),
                            "--name", NAME, "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port",
                            str(metrics), "--max-decode-length", str(MAX_DECODE)],
                           work / "dev_server.log", grpc, [f"{NAME}_{task}" for task in TASKS])
    try:
        with TritonServer(work / "repo", install=triton_install, log_file=work / "server.log") as server:
            yield {
                "urls": {"repository": {"http": f"http://{server.endpoints.http_url}",
                                        "grpc": f"grpc://{server.endpoints.grpc_url}"},
                         "dev": {"http": f"http://127.0.0.1:{http}", "grpc": f"grpc://127.0.0.1:{grpc}"}},
                "checkpoint": checkpoint, "loaded": family.load(checkpoint), "repository": work / "repo",
                "log": work / "dev_server.log",
            }
    finally:
        stop_dev_server(dev)


def _smiles(count: int = 6) -> list[str]:
    return get_family("megamolbart").sample_sequences()[:count]


def _both(servers, protocol: str = "grpc") -> list[RepositoryClient]:
    return [RepositoryClient(NAME, servers["urls"][kind][protocol]) for kind in ("repository", "dev")]


def test_the_dev_server_binds_the_repositorys_public_models_and_tensors(servers):
    metadata = {}
    for kind in ("repository", "dev"):
        client = grpcclient.InferenceServerClient(servers["urls"][kind]["grpc"].removeprefix("grpc://"))
        metadata[kind] = {}
        for task in TASKS:
            answer = client.get_model_metadata(f"{NAME}_{task}", as_json=True)
            assert isinstance(answer, dict), answer  # as_json: parsed JSON, not a protobuf
            metadata[kind][task] = {side: sorted((t["name"], t["datatype"], tuple(t["shape"])) for t in answer[side])
                                    for side in ("inputs", "outputs")}
    assert metadata["dev"] == metadata["repository"]
    assert "mmb_decodes" in servers["log"].read_text()  # the dev server said what it binds


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_encoder_answers_agree_within_the_family_tolerance(servers, protocol):
    atol = get_family("megamolbart").atol
    smiles = _smiles()
    answers = []
    for client in _both(servers, protocol):
        with client:
            answers.append((client.seqs_to_embedding(smiles), *client.seqs_to_hidden(smiles)))
    (repo_embeddings, repo_hiddens, repo_mask), (dev_embeddings, dev_hiddens, dev_mask) = answers
    np.testing.assert_array_equal(dev_mask, repo_mask)
    assert dev_hiddens.shape == repo_hiddens.shape
    np.testing.assert_allclose(dev_hiddens, repo_hiddens, atol=atol)  # padding included: zero in both
    np.testing.assert_allclose(dev_embeddings, repo_embeddings, atol=atol)
    reference, _ = encode_hiddens(servers["loaded"], smiles)
    np.testing.assert_allclose(dev_hiddens[dev_mask], reference[dev_mask], atol=atol)


def test_decodes_are_equal(servers):
    hiddens, mask = encode_hiddens(servers["loaded"], _smiles(8))
    decoded = []
    for client in _both(servers):
        with client:
            decoded.append(client.hidden_to_seqs(hiddens, mask))
    assert decoded[0] == decoded[1] == reference_decode(servers["loaded"], hiddens, mask, MAX_DECODE)


@pytest.mark.parametrize(("method", "parameters"), SAMPLING_CHECKS)
def test_seeded_samples_are_equal(servers, method, parameters):
    smiles = _smiles(3)
    samples = []
    for client in _both(servers):
        with client:
            samples.append(client.sample_seqs(smiles, sampling_method=method, seed=11, **parameters))
    assert [len(row) for row in samples[1]] == [expected_outputs(method, parameters)] * 3
    assert samples[0] == samples[1] == reference_sample(servers["loaded"], smiles, seed=11, method=method,
                                                        max_length=MAX_DECODE, **parameters)
    with _both(servers)[1] as dev:
        assert dev.sample_seqs(smiles) != []  # defaults: greedy-perturbate, one sample each
        assert [len(row) for row in dev.sample_seqs(smiles)] == [1, 1, 1]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_pytriton_model_client_decodes_and_samples_on_both(servers, protocol):
    from pytriton.client import ModelClient

    smiles = _smiles(4)
    hiddens, mask = encode_hiddens(servers["loaded"], smiles)
    answers = []
    for kind in ("repository", "dev"):
        url = servers["urls"][kind][protocol]
        with ModelClient(url, f"{NAME}_decodes", init_timeout_s=60) as client:
            decoded = client.infer_batch(hiddens=hiddens, mask=mask)["sequences"]
        with ModelClient(url, f"{NAME}_samplings", init_timeout_s=60) as client:
            generated = client.infer_batch(sequences=np.char.encode(np.array([[s] for s in smiles]), "utf-8"),
                                           seed=np.full((4, 1), 3, np.int64))["generated"]
        assert decoded.shape == (4, 1) and generated.shape == (4, 1)
        answers.append((decoded.tolist(), generated.tolist()))
    assert answers[0] == answers[1]
    assert [row[0].decode() for row in answers[0][0]] == reference_decode(servers["loaded"], hiddens, mask, MAX_DECODE)


@pytest.mark.parametrize("kind", ["repository", "dev"])
def test_encode_to_json_then_decode_round_trips(servers, kind, tmp_path):
    """BioNeMo's client_encode -> hiddens JSON -> client_decode, with this tool's client commands."""
    url = servers["urls"][kind]["http"]
    smiles = _smiles(5)
    encode = ["client", "encode", "--model", f"{NAME}_hiddens", "--triton-url", url,
              "--output", str(tmp_path / "hiddens.json")]
    for item in smiles:
        encode += ["-s", item]
    result = runner.invoke(app, encode, env=WIDE)
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["client", "decode", "--model", f"{NAME}_decodes", "--triton-url", url,
                                 "--input", str(tmp_path / "hiddens.json"), "--output", str(tmp_path / "smiles.json")],
                           env=WIDE)
    assert result.exit_code == 0, result.output
    decoded = json.loads((tmp_path / "smiles.json").read_text())
    hiddens, mask, _ = read_hiddens(tmp_path / "hiddens.json")
    assert mask is not None  # client encode writes the mask beside the hiddens
    assert decoded == reference_decode(servers["loaded"], hiddens, mask, MAX_DECODE)
    with RepositoryClient(NAME, url) as client:
        assert decoded == client.hidden_to_smis(*client.smis_to_hidden(smiles))

    # BioNeMo's decode input may leave the mask out (all True): the longest sequence has no padding.
    document = json.loads((tmp_path / "hiddens.json").read_text())
    longest = int(np.argmax(mask.sum(axis=1)))
    assert mask[longest].all()
    (tmp_path / "no_mask.json").write_text(json.dumps({"hiddens": document["hiddens"][longest:longest + 1]}))
    result = runner.invoke(app, ["client", "decode", "--model", f"{NAME}_decodes", "--triton-url", url,
                                 "--input", str(tmp_path / "no_mask.json")], env=WIDE)
    assert result.exit_code == 0 and result.stdout.splitlines() == [decoded[longest]], result.output


def test_encode_npz_decode_npz_and_sample_write_strings(servers, tmp_path):
    url = servers["urls"]["dev"]["grpc"]
    smiles = _smiles(4)
    (tmp_path / "molecules.smi").write_text("".join(f"{s} mol{i}\n" for i, s in enumerate(smiles)))
    result = runner.invoke(app, ["client", "encode", "--model", f"{NAME}_hiddens", "--triton-url", url, "--input",
                                 str(tmp_path / "molecules.smi"), "--output", str(tmp_path / "hiddens.npz")], env=WIDE)
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["client", "decode", "--model", f"{NAME}_decodes", "--triton-url", url, "--input",
                                 str(tmp_path / "hiddens.npz"), "--output", str(tmp_path / "smiles.npz")], env=WIDE)
    assert result.exit_code == 0, result.output
    with np.load(tmp_path / "smiles.npz", allow_pickle=False) as saved:
        assert saved["ids"].tolist() == [f"mol{i}" for i in range(4)]
        with RepositoryClient(NAME, url) as client:
            assert saved["sequences"].tolist() == client.hidden_to_seqs(*client.seqs_to_hidden(smiles))

    sample = ["client", "sample", "--model", f"{NAME}_samplings", "--triton-url", url, "--num-samples", "2",
              "--sampling-method", "beam-search-perturbate-sample", "--beam-size", "2", "--seed", "3",
              "--output", str(tmp_path / "samples.json")]
    result = runner.invoke(app, sample + ["-s", smiles[0], "-s", smiles[1]], env=WIDE)
    assert result.exit_code == 0, result.output
    generated = json.loads((tmp_path / "samples.json").read_text())["generated"]
    assert all(isinstance(item, str) for row in generated for item in row)  # strings, not bytes reprs
    for client in _both(servers):
        with client:
            assert generated == client.sample_seqs(smiles[:2], num_samples=2, beam_size=2, seed=3,
                                                   sampling_method="beam-search-perturbate-sample")


def test_python_client_takes_torch_tensors(servers):
    smiles = _smiles(3)
    with _both(servers)[1] as client:
        hiddens, mask = client.smis_to_hidden(smiles)
        from_torch = client.hidden_to_smis(torch.from_numpy(hiddens), torch.from_numpy(mask))
        assert from_torch == client.hidden_to_seqs(hiddens, mask)
        assert client.seqs_to_embedding(np.array(smiles)).shape == (3, servers["loaded"].hidden_size)


def test_errors_from_both_servers_carry_the_message(servers):
    for client in _both(servers):
        with client:
            with pytest.raises(InferenceError, match="not in the vocabulary"):
                client.seqs_to_embedding(["CCO\u00e9"])
            with pytest.raises(InferenceError, match="max_num_samples"):
                client.sample_seqs(["CCO"], num_samples=1000)
            with pytest.raises(InferenceError, match="unknown sampling method"):
                client.sample_seqs(["CCO"], sampling_method="no-such-method")


def test_both_servers_parse_sampling_options_with_one_module(servers):
    """serving/request_options.py parses N_samplings' options in the repository and in the dev
    server: a NaN radius (on every row) is not finite in both, never "must have one value"."""
    for client in _both(servers):
        with client:
            with pytest.raises(InferenceError) as caught:
                client.sample_seqs(["CCO", "CCN"], scaled_radius=float("nan"))
            assert "input 'scaled_radius' row 0 must be finite, got nan" in str(caught.value)


def test_verify_passes_against_the_dev_server(servers):
    checks = verify_repository(servers["repository"], servers["checkpoint"], url=servers["urls"]["dev"]["grpc"])
    assert {check.model for check in checks} == {f"{NAME}_{task}" for task in TASKS}
    assert all(check.passed for check in checks), [check for check in checks if not check.passed]
