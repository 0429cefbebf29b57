"""Whose fault a failed request is (client/triton.py), and what ServerPool and infer_rows do about it
(client/server_pool.py, client/batches.py), with stand-in servers whose answers are scripted.

The stand-ins raise tritonclient's real InferenceServerException with the status strings and
messages real tritonservers answered (measured on Triton 2.51; tests/e2e/test_transient_failures.py
sees them from real servers), or the socket errors its HTTP client raises, and hand them to the real
TritonClient's translation: only the server is a stand-in, never the pool or the engine under test.
"""

from __future__ import annotations

from concurrent.futures import Future
from http.client import RemoteDisconnected

import numpy as np
import pytest
from geventhttpclient.response import HTTPConnectionClosed
from tritonclient.utils import InferenceServerException

from bionemo_export.client.batches import infer_rows
from bionemo_export.client.server_pool import ServerPool
from bionemo_export.client.triton import (
    Failure,
    InferenceError,
    ModelNotServedError,
    ServerBusyError,
    ServerFailedError,
    ServerUnreachableError,
    TritonClient,
    TritonUrl,
    failure_kind,
    is_transient,
)

A, B = "grpc://a:8001", "grpc://b:8001"
INPUTS = {"x": np.array([[1.0]], dtype=np.float32)}
STUB_DIED = "Stub process 'affine_0_0' is not healthy."
SHAPE = ("[request id: <id_unknown>] unexpected shape for input 'x' for model 'affine'. Expected [-1,-1], got "
         "[1,2,3]. NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be "
         "prepended to each input shape.")


def ise(message: str, status: str) -> InferenceServerException:
    return InferenceServerException(message, status=status)


# -- whose fault ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("message", "status", "kind"), [
    # A killed Python-backend stub (Triton 2.51, measured over gRPC and HTTP)
    (STUB_DIED, "StatusCode.INTERNAL", Failure.FAILED),
    (STUB_DIED, "500", Failure.FAILED),
    ("Stub process is not healthy.", "StatusCode.INTERNAL", Failure.FAILED),  # python_backend's other wording
    ("esm2nv_samplings: Stub process 'esm2nv_decoder_0_1' is not healthy.", "StatusCode.INTERNAL", Failure.FAILED),
    # gRPC: killed server, nothing listening, the client's deadline (measured)
    ("Stream removed (Socket closed)", "StatusCode.UNAVAILABLE", Failure.UNREACHABLE),
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:24514: Failed to connect to remote "
     "host: Connection refused", "StatusCode.UNAVAILABLE", Failure.UNREACHABLE),
    ("Deadline Exceeded", "StatusCode.DEADLINE_EXCEEDED", Failure.FAILED),
    ("", "StatusCode.CANCELLED", Failure.FAILED),
    ("esm2nv_encoder: the request was cancelled", "400", Failure.FAILED),  # HTTP carries CANCELLED as 400
    ("out of memory", "StatusCode.RESOURCE_EXHAUSTED", Failure.FAILED),
    ("Received message larger than max (2147483648 vs. 2147483647)", "StatusCode.RESOURCE_EXHAUSTED",
     Failure.REQUEST),
    # a server shutting down, or reloading the model
    ("Request for unknown model: 'affine' is not found", "StatusCode.NOT_FOUND", Failure.NOT_SERVED),
    ("Request for unknown model: 'affine' is not found", "400", Failure.NOT_SERVED),
    ("Server is stopping, scheduler for model has stopped accepting new inference requests", "503",
     Failure.UNREACHABLE),
    ("Server not ready", "StatusCode.UNAVAILABLE", Failure.UNREACHABLE),
    ("Exceeds maximum queue size", "StatusCode.UNAVAILABLE", Failure.BUSY),
    ("Request timeout expired", "503", Failure.BUSY),
    ("bad gateway", "502", Failure.UNREACHABLE),
    # the request's own fault: Triton's checks, the project's models, a native backend failing on it
    (SHAPE, "StatusCode.INVALID_ARGUMENT", Failure.REQUEST),
    (SHAPE, "400", Failure.REQUEST),
    ("[request id: <id_unknown>] inference request batch-size must be <= 8 for 'affine'",
     "StatusCode.INVALID_ARGUMENT", Failure.REQUEST),
    ("esm2nv_embeddings: sequence 0 has an invalid character 'J' at position 3; allowed characters: ACDEFGHIKLMNPQRS"
     "TVWXY", "StatusCode.INVALID_ARGUMENT", Failure.REQUEST),
    ("esm2nv_encoder: internal error (RuntimeError); the server log has the details", "StatusCode.INTERNAL",
     Failure.REQUEST),
    ("onnx runtime error 2: Non-zero status code returned while running Gather node. Name:'/embed/Gather' "
     "idx=1026 must be within the inclusive range [-1026,1025]", "500", Failure.REQUEST),
])
def test_whose_fault_a_failure_is(message, status, kind):
    assert failure_kind(message, status) is kind
    assert is_transient(message, status) is (kind is not Failure.REQUEST)


@pytest.mark.parametrize(("recorded", "transient"), [
    # what journals of earlier versions hold for records a server failed: the message alone
    (STUB_DIED, True),
    ("Deadline Exceeded", True),
    ("the server is busy and turned the request away (Exceeds maximum queue size); retry later or send fewer "
     "requests at once", True),
    ("the server at grpc://a:8001 does not serve it now (Request for unknown model: 'm' is not found)", True),
    ("sequence 0 has an invalid character 'J' at position 3; allowed characters: ACDEFGHIKLMNPQRSTVWXY", False),
    ("sequence 0 has 1200 residues; the maximum is 1022 (1024 tokens including <cls>/<eos>)", False),
    ("no sequence", False),
])
def test_a_recorded_message_alone_says_whether_it_was_transient(recorded, transient):
    assert is_transient(recorded) is transient


def _translated(url: str, err: Exception, model: str = "affine") -> Exception:
    """`err` as the real TritonClient turns it into ours (no request is sent: tritonclient connects
    only when asked to send)."""
    client = TritonClient(url, timeout_s=30)
    try:
        return client._translate(model)(err)
    finally:
        client.close()


@pytest.mark.parametrize(("url", "raised", "ours"), [
    (A, ise(STUB_DIED, "StatusCode.INTERNAL"), ServerFailedError),
    (A, ise("Deadline Exceeded", "StatusCode.DEADLINE_EXCEEDED"), ServerFailedError),
    (A, ise("Stream removed (Socket closed)", "StatusCode.UNAVAILABLE"), ServerUnreachableError),
    (A, ise("Request for unknown model: 'affine' is not found", "StatusCode.NOT_FOUND"), ModelNotServedError),
    (A, ise("Exceeds maximum queue size", "StatusCode.UNAVAILABLE"), ServerBusyError),
    (A, ise(SHAPE, "StatusCode.INVALID_ARGUMENT"), InferenceError),
    ("http://a:8000", ise(STUB_DIED, "500"), ServerFailedError),
    ("http://a:8000", ise("Server is stopping, scheduler for model has stopped accepting new inference requests",
                          "503"), ServerUnreachableError),
    ("http://a:8000", HTTPConnectionClosed("connection closed."), ServerUnreachableError),  # no OSError
    ("http://a:8000", RemoteDisconnected("Remote end closed connection without response"), ServerUnreachableError),
    ("http://a:8000", ConnectionRefusedError(111, "Connection refused"), ServerUnreachableError),
    ("http://a:8000", TimeoutError("timed out"), ServerFailedError),
])
def test_the_client_raises_each_failure_as_its_kind_and_its_words_say_so_again(url, raised, ours):
    err = _translated(url, raised)
    assert type(err) is ours and err.__cause__ is raised
    # The job reads recorded messages back with is_transient: ours must classify as they were raised.
    assert is_transient(str(err)) is (ours is not InferenceError), str(err)


# -- stand-in servers -------------------------------------------------------------------------------

class ScriptedServer:
    """Answers each request with the next item of its URL's script: an exception to raise (tritonclient's,
    or a socket's: translated by the real TritonClient), a function of the inputs, or an answer. With
    the script spent, it answers y = 2 x + 1."""

    scripts: dict[str, list] = {}
    sent: list[str] = []

    def __init__(self, url: str, concurrency: int = 1) -> None:
        self.url = TritonUrl.parse(url)
        self.name = url
        self.translate = lambda model, err: _translated(url, err, model)

    def submit(self, model, inputs, outputs=None) -> Future:
        ScriptedServer.sent.append(self.name)
        future: Future = Future()
        script = self.scripts[self.name]
        item = script.pop(0) if script else None
        try:
            if isinstance(item, Exception):
                raise item
            answer = item(inputs) if callable(item) else item
            future.set_result(answer if answer is not None else {"y": 2 * inputs["x"] + 1})
        except (InferenceServerException, OSError, HTTPConnectionClosed) as err:
            future.set_exception(self.translate(model, err))
        return future

    def max_batch_size(self, model):
        return 4

    def model_config(self, model):
        item = self.scripts[self.name][0] if self.scripts[self.name] else None
        if isinstance(item, Exception):
            raise self.translate(model, self.scripts[self.name].pop(0))
        return {"max_batch_size": 4}

    def close(self):
        pass


class Clock:
    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock():
    ScriptedServer.sent = []
    return Clock()


def _pool(clock, scripts: dict[str, list], **settings) -> ServerPool:
    ScriptedServer.scripts = scripts
    settings.setdefault("jitter", lambda: 1.0)  # no jitter unless a test asks: waits are then exact
    return ServerPool(list(scripts), client=ScriptedServer,  # pyright: ignore[reportArgumentType]  (duck-typed)
                      clock=clock, sleep=clock.sleep, **settings)


# -- the pool ---------------------------------------------------------------------------------------

def test_requests_go_to_the_least_loaded_server(clock):
    pool = _pool(clock, {A: [], B: []})
    first, second, third = (pool.submit("m", INPUTS) for _ in range(3))
    assert ScriptedServer.sent == [A, B, A]
    for request in (first, second, third):
        request.result()
    assert pool.statistics.answered == [2, 1] and pool.in_flight == [0, 0]


def test_a_busy_answer_is_sent_again_after_a_doubling_backoff_with_jitter(clock):
    busy = ise("Exceeds maximum queue size", "StatusCode.UNAVAILABLE")
    pool = _pool(clock, {A: [busy, busy, busy]}, backoff_s=0.5, max_backoff_s=1.5)
    assert pool.submit("m", INPUTS).result()["y"].tolist() == [[3.0]]
    assert clock.slept == [0.5, 1.0, 1.5] and pool.statistics.busy_retries == 3
    halved = _pool(Clock(), {A: [busy, busy]}, backoff_s=0.5, jitter=lambda: 0.0)
    halved.submit("m", INPUTS).result()
    assert halved.sleep.__self__.slept == [0.25, 0.5]  # each wait drawn between half and all of the backoff


def test_an_unreachable_server_is_set_aside_and_its_request_moved(clock):
    pool = _pool(clock, {A: [ise("Stream removed (Socket closed)", "StatusCode.UNAVAILABLE")], B: []}, down_for_s=5.0)
    assert pool.submit("m", INPUTS).result()["y"].tolist() == [[3.0]]
    assert ScriptedServer.sent == [A, B] and pool.statistics.moved == 1
    pool.submit("m", INPUTS).result()
    assert ScriptedServer.sent[-1] == B  # A is still set aside
    clock.now += 5.0
    pool.submit("m", INPUTS).result()
    pool.submit("m", INPUTS).result()
    assert A in ScriptedServer.sent[-2:]  # back after down_for_s


def test_an_http_connection_closed_mid_request_is_moved_not_raised(clock):
    """Finding: geventhttpclient's HTTPConnectionClosed (a server stopping under an HTTP job) is no
    OSError; it escaped the client untranslated and ended the job with a traceback."""
    pool = _pool(clock, {"http://a:8000": [HTTPConnectionClosed("connection closed.")], "http://b:8000": []})
    assert pool.submit("m", INPUTS).result()["y"].tolist() == [[3.0]]
    assert ScriptedServer.sent == ["http://a:8000", "http://b:8000"] and pool.statistics.moved == 1


@pytest.mark.parametrize("failure", [ise(STUB_DIED, "StatusCode.INTERNAL"),
                                     ise("Deadline Exceeded", "StatusCode.DEADLINE_EXCEEDED"),
                                     ise("", "StatusCode.CANCELLED")])
def test_a_server_failure_goes_to_another_server_at_once_and_is_told(clock, failure):
    told = []
    pool = _pool(clock, {A: [failure], B: []}, backoff_s=0.5, on_retry=lambda *retry: told.append(retry))
    assert pool.submit("m", INPUTS).result()["y"].tolist() == [[3.0]]
    assert ScriptedServer.sent == [A, B] and clock.slept == []  # no wait: B was up
    assert pool.statistics.transient_retries == 1 and pool.statistics.answered == [0, 1]
    assert told == [("transient", A, failure.message())]
    pool.submit("m", INPUTS).result()
    assert ScriptedServer.sent[-1] == B  # A set aside for the backoff
    clock.now += 0.5
    pool.submit("m", INPUTS).result()
    pool.submit("m", INPUTS).result()
    assert A in ScriptedServer.sent[-2:]


def test_one_server_whose_stub_restarts_is_waited_for_with_a_growing_backoff(clock):
    """What a dead stub answers until serve's supervisor has reloaded the model: the same request,
    sent again after 0.5, 1, 2, 2 s, is answered."""
    died = ise(STUB_DIED, "StatusCode.INTERNAL")
    told = []
    pool = _pool(clock, {A: [died] * 4}, backoff_s=0.5, max_backoff_s=2.0, on_retry=lambda *retry: told.append(retry))
    assert pool.submit("m", INPUTS).result()["y"].tolist() == [[3.0]]
    assert ScriptedServer.sent == [A] * 5 and clock.now == pytest.approx(0.5 + 1 + 2 + 2)
    assert pool.statistics.transient_retries == 4 and [kind for kind, _, _ in told] == ["transient"] * 4


def test_a_request_failing_for_give_up_s_ends_the_run_naming_each_server_and_its_last_answer(clock):
    pool = _pool(clock, {A: [ise(STUB_DIED, "StatusCode.INTERNAL")] * 100,
                         B: [ise("failed to connect to all addresses", "StatusCode.UNAVAILABLE")] * 100},
                 backoff_s=1.0, max_backoff_s=2.0, down_for_s=2.0, give_up_s=10.0)
    with pytest.raises(ServerUnreachableError) as raised:
        pool.submit("m", INPUTS).result()
    message = str(raised.value)
    assert f"{A}: {STUB_DIED}" in message and f"{B}: failed to connect to all addresses" in message, message
    assert "for 10 s" in message and "run again" in message and "\n" not in message
    assert 10.0 <= clock.now <= 13.0  # bounded: give_up_s after the first failure, and a last wait
    assert pool.in_flight == [0, 0]


def test_a_records_own_fault_is_not_retried(clock):
    pool = _pool(clock, {A: [ise(SHAPE, "StatusCode.INVALID_ARGUMENT")], B: []})
    with pytest.raises(InferenceError, match="unexpected shape") as raised:
        pool.submit("m", INPUTS).result()
    assert not isinstance(raised.value, ServerFailedError)
    assert ScriptedServer.sent == [A] and pool.in_flight == [0, 0] and pool.statistics.answered == [1, 0]


def test_a_server_that_no_longer_serves_the_model_is_set_aside_like_an_unreachable_one(clock):
    """Finding (CI): a tritonserver shutting down unloads its models before it closes its port, and
    answers every request meanwhile with "Request for unknown model" (NOT_FOUND): 76 of 300 records
    were listed as bad. That answer is the server's state, not the record's fault."""
    gone = ise("Request for unknown model: 'm' is not found", "StatusCode.NOT_FOUND")
    pool = _pool(clock, {A: [gone], B: []}, down_for_s=5.0)
    assert pool.submit("m", INPUTS).result()["y"].tolist() == [[3.0]]
    assert ScriptedServer.sent == [A, B] and pool.statistics.moved == 1


def test_one_server_reloading_its_model_is_waited_for(clock):
    """With one server, a model that serve's supervisor is reloading is waited for, not failed."""
    gone = ise("Request for unknown model: 'm' is not found", "StatusCode.NOT_FOUND")
    pool = _pool(clock, {A: [gone, gone]}, down_for_s=1.0)
    assert pool.submit("m", INPUTS).result()["y"].tolist() == [[3.0]]
    assert ScriptedServer.sent == [A, A, A] and clock.now >= 2.0


def test_the_models_configuration_comes_from_the_first_server_that_gives_it(clock):
    pool = _pool(clock, {A: [ise("failed to connect to all addresses", "StatusCode.UNAVAILABLE")], B: []})
    assert pool.max_batch_size("m") == 4
    nowhere = ise("Request for unknown model: 'm_contacts' is not found", "StatusCode.NOT_FOUND")
    pool = _pool(clock, {A: [nowhere], B: [nowhere]})
    with pytest.raises(ModelNotServedError):  # what `--include contacts` tells the user of
        pool.model_config("m_contacts")


# -- infer_rows over the pool, isolating rows -------------------------------------------------------

def _rows(count: int):
    return lambda rows, _: {"x": rows.astype(np.float32).reshape(-1, 1)}


def _refusing(row: int):
    """A server's answer for a request holding `row`: INVALID_ARGUMENT, as a model's tokenizer answers."""
    def answer(inputs):
        if row in inputs["x"][:, 0]:
            raise ise(f"m: sequence {row} has an invalid character 'J' at position 0", "StatusCode.INVALID_ARGUMENT")
        return None
    return answer


def test_rows_a_server_failed_are_answered_once_it_is_back_and_none_is_listed_as_bad(clock):
    died = ise(STUB_DIED, "StatusCode.INTERNAL")
    pool = _pool(clock, {A: [None, died, died, died]}, backoff_s=0.1)
    results = infer_rows(pool, "m", 12, _rows(12), batch_size=4, in_flight=2, isolate=True)
    assert results.failures == [] and results.rows.tolist() == list(range(12))
    assert results.outputs["y"][:, 0].tolist() == [2.0 * row + 1 for row in range(12)]
    assert pool.statistics.transient_retries == 3


def test_a_server_failure_is_never_isolated_into_bad_rows(clock):
    """Finding: a request a restarting stub failed was sent again row by row, every row failed the
    same way, and every row was listed as a bad record for good. Now the failure ends the run."""
    pool = _pool(clock, {A: [None] + [ise(STUB_DIED, "StatusCode.INTERNAL")] * 100}, give_up_s=5.0)
    with pytest.raises(ServerUnreachableError, match="is not healthy"):
        infer_rows(pool, "m", 12, _rows(12), batch_size=4, in_flight=1, isolate=True)
    assert len(ScriptedServer.sent) < 100  # sent again as one request, not row by row
    one = _pool(Clock(), {A: [None, ise("Deadline Exceeded", "StatusCode.DEADLINE_EXCEEDED")]})
    with pytest.raises(ServerFailedError, match="Deadline Exceeded"):  # one client: raised at once
        infer_rows(one.clients[0], "m", 12, _rows(12), batch_size=4, in_flight=1, isolate=True)  # pyright: ignore[reportArgumentType]


def test_a_refused_request_is_isolated_to_its_bad_row(clock):
    pool = _pool(clock, {A: [_refusing(5)] * 6})
    results = infer_rows(pool, "m", 8, _rows(8), batch_size=4, in_flight=1, isolate=True)
    assert results.rows.tolist() == [0, 1, 2, 3, 4, 6, 7]
    assert results.failures == [(5, "sequence 5 has an invalid character 'J' at position 0")]


def test_a_server_failure_of_a_row_sent_alone_raises_rather_than_listing_it(clock):
    """A batch refused for one bad row is sent again row by row; a dead stub then fails one of those
    rows. That row is not the bad one: the run ends (one client) instead of listing it."""
    # Requests in turn (in_flight 1): rows 0-3, rows 4-7 (refused), then rows 4, 5, ... alone.
    one = _pool(clock, {A: [None, _refusing(5), None, ise(STUB_DIED, "500")]})
    with pytest.raises(ServerFailedError, match="is not healthy"):
        infer_rows(one.clients[0], "m", 8, _rows(8), batch_size=4, in_flight=1, isolate=True)  # pyright: ignore[reportArgumentType]
    pool = _pool(clock, {A: [None, _refusing(5), None, ise(STUB_DIED, "500")] + [_refusing(5)] * 3}, backoff_s=0.1)
    results = infer_rows(pool, "m", 8, _rows(8), batch_size=4, in_flight=1, isolate=True)
    assert results.failures == [(5, "sequence 5 has an invalid character 'J' at position 0")]
    assert results.rows.tolist() == [0, 1, 2, 3, 4, 6, 7] and pool.statistics.transient_retries == 1
