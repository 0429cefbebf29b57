"""Admission control on a real tritonserver: a full queue answers at once with UNAVAILABLE / HTTP 503,
through the public ensemble, and the project's clients say the server is busy.

Finding: nothing limited how many requests wait, so latency grew without bound (a one-molecule
request waited 71 s behind 20 abandoned sampling requests). One tiny random ESM-2 repository is
built with a queue of 2 requests and served by `TritonServer` on free loopback ports.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.client import EncoderClient, ServerBusyError
from bionemo_export.client.triton import TURNED_AWAY
from bionemo_export.model_repository.options import ServingOptions
from bionemo_export.runtime import TritonServer
from bionemo_export.testing.checkpoints import save_random_checkpoint

NAME = "adm"
LONG = "MKTAYIAKQRQISFVKSHFSRQ" * 46  # 1012 residues
CLIENTS = 30


@pytest.fixture(scope="module")
def server(tmp_path_factory, triton_install):
    work = tmp_path_factory.mktemp("admission")
    checkpoint = save_random_checkpoint("esm2", work / "checkpoint", seed=0)
    build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name=NAME, out=work / "repo",
                                  backend="python", serving=ServingOptions(max_batch_size=4, max_queue_size=2),
                                  optimize=False))
    with TritonServer(work / "repo", install=triton_install, log_file=work / "tritonserver.log") as running:
        yield running


def _flood(server: TritonServer) -> list[tuple[str, str, float]]:
    """CLIENTS requests of 4 long sequences at once, half over HTTP, half over gRPC: (protocol,
    "ok" or the status and message, seconds) each."""
    results: list[tuple[str, str, float]] = []
    start = threading.Barrier(CLIENTS)

    def one(index: int) -> None:
        module = grpcclient if index % 2 else httpclient
        address = server.endpoints.grpc_url if index % 2 else server.endpoints.http_url
        client = module.InferenceServerClient(address)
        tensor = module.InferInput("sequences", [4, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[LONG.encode()]] * 4, dtype=np.object_))
        start.wait()
        sent = time.monotonic()
        try:
            client.infer(f"{NAME}_embeddings", [tensor])
            outcome = "ok"
        except InferenceServerException as err:
            outcome = f"{err.status()} {err.message()}"
        results.append((module.__name__.rsplit(".", 1)[-1], outcome, time.monotonic() - sent))
        client.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def test_a_full_queue_answers_at_once_with_unavailable(server):
    results = _flood(server)
    assert len(results) == CLIENTS
    refused = [r for r in results if r[1] != "ok"]
    assert refused, "nothing was turned away: the queue bound did not reach the config"
    assert [r for r in results if r[1] == "ok"], "nothing was answered"
    for protocol, outcome, seconds in refused:
        assert any(marker in outcome for marker in TURNED_AWAY), outcome
        assert outcome.startswith("StatusCode.UNAVAILABLE" if protocol == "grpc" else "503"), (protocol, outcome)
        assert seconds < 2.0, f"a refusal took {seconds:.1f} s: it waited instead of being answered at once"
    # The server carries on: one request alone is answered.
    with EncoderClient(NAME, f"grpc://{server.endpoints.grpc_url}") as client:
        assert client.seqs_to_embedding(["MKTAY"]).shape == (1, 32)
    print(f"{len(refused)} of {CLIENTS} turned away, slowest refusal {max(r[2] for r in refused):.3f} s")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_clients_say_the_server_is_busy(server, protocol):
    """A refusal reaches the project's clients as ServerBusyError (an InferenceError), which says to
    retry later, not as 'server unreachable' (gRPC's UNAVAILABLE status also means that)."""
    url = f"{protocol}://" + (server.endpoints.grpc_url if protocol == "grpc" else server.endpoints.http_url)
    errors: list[Exception] = []
    answered = []

    def one() -> None:
        with EncoderClient(NAME, url) as client:
            try:
                answered.append(client.seqs_to_embedding([LONG] * 4))
            except Exception as err:  # noqa: BLE001 - sorted below
                errors.append(err)

    threads = [threading.Thread(target=one) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors and answered, (len(errors), len(answered))
    for err in errors:
        assert isinstance(err, ServerBusyError), repr(err)
        assert "busy" in str(err) and "retry later" in str(err)
