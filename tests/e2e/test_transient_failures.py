"""A server that fails for a moment never makes a bad record: `infer_rows(isolate=True)` through a
ServerPool, against real tritonservers (tests/helpers/tiny_repository.py's `affine`, y = 2 x + 1, and
`length_embeddings`, a public model that serve's supervisor watches), while the server is stopped and
started again on the same ports, or while the model's Python-backend stub is killed.

What Triton 2.51 answers meanwhile (measured; client/triton.py classifies it): over gRPC "Request
for unknown model: 'affine' has no available versions" (NOT_FOUND) while it unloads, "Stream removed
(Socket closed)" for a request in flight when it dies and "failed to connect to all addresses; ...
Connection refused" (UNAVAILABLE) while it is down; over HTTP ConnectionRefusedError, and
"connection closed." (geventhttpclient's HTTPConnectionClosed, no OSError) for a request sent on a
kept-alive connection while it stops; to a request that reaches a killed stub, INTERNAL / HTTP 500
"Stub process 'affine_0_0' is not healthy.". Triton 2.51 never restarts a dead stub (python_backend
stopped doing so in r24.07): `serve`'s supervisor reloads the model; under a bare tritonserver the
pool gives up after give_up_s with an error naming the server and its last answer, and lists
nothing as a bad record.

Only processes the tests started are signalled.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import numpy as np
import pytest

from bionemo_export.client.batches import infer_rows
from bionemo_export.client.server_pool import ServerPool
from bionemo_export.client.triton import ServerUnreachableError, strings_to_tensor
from bionemo_export.runtime import TritonServer
from tests.helpers import serve_process as sp
from tests.helpers.tiny_repository import length_encoder_repository

ROWS = 400


def _x(rows: np.ndarray, _: int) -> dict[str, np.ndarray]:
    return {"x": rows.astype(np.float32).reshape(-1, 1)}


def _at(row_count: int, action: Callable[[], None]) -> Callable[[int], None]:
    """infer_rows' progress callback that runs `action` once `row_count` rows are done."""
    done = [0]

    def progress(rows: int) -> None:
        before, done[0] = done[0], done[0] + rows
        if before < row_count <= done[0]:
            action()

    return progress


def _pool(url: str, give_up_s: float = 60.0) -> ServerPool:
    return ServerPool([url], concurrency=4, backoff_s=0.05, max_backoff_s=0.5, down_for_s=0.3, give_up_s=give_up_s)


def _all_answered(results) -> None:
    assert results.failures == []  # nothing listed as a bad record
    assert results.rows.tolist() == list(range(ROWS))
    np.testing.assert_array_equal(results.outputs["y"][:, 0], 2 * np.arange(ROWS, dtype=np.float32) + 1)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_server_stopped_and_started_again_mid_run_loses_no_row(tiny_repo, triton_install, tmp_path, protocol):
    """The server is stopped (SIGTERM: it unloads its models, then closes its ports) a third of the
    way through and started again on the same ports: every row is answered, none listed as bad."""
    server = TritonServer(tiny_repo, install=triton_install, log_file=tmp_path / "first.log", exit_timeout=1).start()
    ports = server.endpoints
    finished = threading.Event()

    def stop_and_start_again() -> None:
        server.stop()
        # Started and stopped by this thread: a server dies with the thread that started it (the
        # parent-death signal follows the thread), so this thread lives as long as the server.
        with TritonServer(tiny_repo, install=triton_install, log_file=tmp_path / "second.log", exit_timeout=1,
                          http_port=ports.http_port, grpc_port=ports.grpc_port, metrics_port=ports.metrics_port):
            finished.wait(120)

    restart = threading.Thread(target=stop_and_start_again)
    url = f"{protocol}://{ports.grpc_url if protocol == 'grpc' else ports.http_url}"
    try:
        with _pool(url) as pool:
            results = infer_rows(pool, "affine", ROWS, _x, batch_size=2, isolate=True,
                                 progress=_at(ROWS // 3, restart.start))
    finally:
        finished.set()
        if restart.is_alive():
            restart.join()
        server.stop()
    _all_answered(results)
    statistics = pool.statistics
    assert statistics.moved + statistics.transient_retries >= 1, statistics  # the restart was seen


@pytest.fixture(scope="module")
def length_repo(tmp_path_factory):
    """`length_embeddings` (tests/helpers/tiny_repository.py): a public model, which serve's
    supervisor watches, that answers [length, sum of code points, 0.5, 0.5] for each sequence."""
    return length_encoder_repository(tmp_path_factory.mktemp("length") / "models", width=4, max_batch_size=8)


def test_a_killed_stub_healed_by_serve_loses_no_row(length_repo, tmp_path):
    """kill -9 of the model's stub mid-run under `bionemo-export serve`: requests that reach the dead
    stub fail ("Stub process 'length_embeddings_0_0' is not healthy."), the pool sends them again
    with backoff, serve's supervisor reloads the model, and every row is answered."""
    sequences = ["M" + "ACDEFGHIKL"[: row % 10] for row in range(ROWS)]
    column = strings_to_tensor(sequences)
    served = sp.serve(length_repo, tmp_path, "--health-interval", "1", "--health-timeout", "2")
    try:
        server = sp.tritonserver_of(served.process.pid)
        earlier = len(served.text())
        retries: list[tuple[str, str, str]] = []

        def kill_the_stub() -> None:
            for stub in sp.stubs(server, "length_embeddings"):
                os.kill(stub, signal.SIGKILL)

        with _pool(f"grpc://127.0.0.1:{served.grpc}") as pool:
            pool.on_retry = lambda kind, url, message: retries.append((kind, url, message))
            results = infer_rows(pool, "length_embeddings", ROWS, lambda rows, _: {"sequences": column[rows]},
                                 batch_size=2, isolate=True, progress=_at(ROWS // 3, kill_the_stub))
        log = served.text()[earlier:]
    finally:
        served.stop()
    assert results.failures == [] and results.rows.tolist() == list(range(ROWS))
    assert results.outputs["embeddings"][:, 0].tolist() == [len(s) for s in sequences]
    assert results.outputs["embeddings"][:, 1].tolist() == [sum(map(ord, s)) for s in sequences]
    assert "health: reloaded length_embeddings" in log, log
    failed = [message for kind, _, message in retries if kind == "transient"]
    assert failed and all(message == "Stub process 'length_embeddings_0_0' is not healthy." for message in failed), \
        retries
    assert pool.statistics.transient_retries == len(failed)


def test_a_stub_nobody_heals_ends_the_run_with_the_servers_answer_not_bad_records(tiny_repo, triton_install,
                                                                                 tmp_path):
    """Under a bare tritonserver nothing reloads a killed stub: after give_up_s of failures the run
    ends with one error naming the server and what it answered, rather than listing rows as bad."""
    with TritonServer(tiny_repo, install=triton_install, log_file=tmp_path / "server.log", exit_timeout=1) as server:
        server_pid = server.pid
        assert server_pid is not None  # a started server has a process

        def kill_the_stub() -> None:
            for stub in sp.stubs(server_pid, "affine"):
                os.kill(stub, signal.SIGKILL)

        url = f"grpc://{server.endpoints.grpc_url}"
        with _pool(url, give_up_s=2.0) as pool, pytest.raises(ServerUnreachableError) as raised:
            infer_rows(pool, "affine", ROWS, _x, batch_size=2, isolate=True, progress=_at(ROWS // 3, kill_the_stub))
    message = str(raised.value)
    assert url in message and "Stub process 'affine_0_0' is not healthy." in message, message
    assert "\n" not in message
