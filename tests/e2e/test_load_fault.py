"""A bounded load and fault test: many clients over HTTP and gRPC, valid and invalid requests mixed,
and an encoder stub killed in the middle of it.

One tiny random ESM-2 repository served by the real `bionemo-export serve` (its supervisor probing
every 2 s). Every valid answer is checked against the PyTorch model of the same checkpoint; every
invalid request must fail alone, as the client's mistake (INVALID_ARGUMENT / HTTP 400), naming
the problem; no request may be lost (each gets an answer or an error within its deadline); the
server's memory (tritonserver and its stubs) stays flat from one round to the next. Then a stub is
killed under load: requests may fail while it is reloaded, never with a wrong answer, and answers
are right again within a minute: from the same tritonserver, or, when the kill caught the stub
holding its shared-memory lock and tritonserver aborted (Triton's Python backend throws
`boost::interprocess::lock_exception`: docs/reference/platform.md), from the one `serve` restarted
on the same ports.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from bionemo_export import procfs
from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.client.triton import TURNED_AWAY
from bionemo_export.model_repository.options import ServingOptions
from bionemo_export.models import load_checkpoint
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.helpers import serve_process as sp

pytestmark = pytest.mark.slow

NAME = "load"
CLIENTS = 48  # concurrent clients, half HTTP, half gRPC
REQUESTS_PER_CLIENT = 12
HEAL_SECONDS = 60
RESIDUES = "ACDEFGHIKLMNPQRSTVWY"
# Invalid requests: (what is wrong, the sequence), each answered with INVALID_ARGUMENT.
INVALID = {
    "a character outside the alphabet": "MKT#AY",
    "an empty sequence": "",
    "a sequence over the maximum length": "M" * 5000,
    "bytes that are not UTF-8": b"MK\xff\xfeAY",
}


@dataclass
class Tally:
    correct: int = 0
    wrong: list = field(default_factory=list)
    refused: int = 0  # invalid requests refused as the client's mistake
    misreported: list = field(default_factory=list)  # invalid requests answered, or refused as the server's
    failed: list = field(default_factory=list)  # valid requests that failed (allowed only while healing)

    def add(self, other: Tally) -> None:
        self.correct += other.correct
        self.refused += other.refused
        self.wrong += other.wrong
        self.misreported += other.misreported
        self.failed += other.failed


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_random_checkpoint("esm2", tmp_path_factory.mktemp("ckpt") / "esm2", seed=0)


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp("load")
    build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name=NAME, out=work / "repo",
                                  backend="python", serving=ServingOptions(max_batch_size=8), optimize=False))
    serve = sp.serve(work / "repo", work, "--health-interval", "2", "--health-timeout", "20")
    yield serve
    serve.stop()


@pytest.fixture(scope="module")
def sequences() -> list[str]:
    rng = np.random.default_rng(0)
    return ["".join(rng.choice(list(RESIDUES), size=int(rng.integers(5, 60)))) for _ in range(64)]


@pytest.fixture(scope="module")
def expected(checkpoint, sequences) -> dict[str, np.ndarray]:
    """Each sequence's embedding from the PyTorch model, computed alone."""
    loaded = load_checkpoint(checkpoint, "esm2")
    out = {}
    with torch.inference_mode():
        for sequence in sequences:
            encoded = loaded.tokenizer.encode([sequence])
            _, embeddings = loaded.encoder(*(torch.from_numpy(a) for a in (
                encoded.input_ids, encoded.attention_mask, encoded.residue_mask)))
            out[sequence] = embeddings.numpy()[0]
    return out


def _client(protocol: str, serve: sp.Serve):
    if protocol == "grpc":
        return grpcclient, grpcclient.InferenceServerClient(f"127.0.0.1:{serve.grpc}")
    return httpclient, httpclient.InferenceServerClient(f"127.0.0.1:{serve.http}", network_timeout=60,
                                                        connection_timeout=60)


def _send(module, client, sequence: str | bytes):
    item = sequence if isinstance(sequence, bytes) else sequence.encode()
    tensor = module.InferInput("sequences", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[item]], dtype=np.object_))
    kwargs = {"client_timeout": 60} if module is grpcclient else {}
    return client.infer(f"{NAME}_embeddings", [tensor], **kwargs).as_numpy("embeddings")[0]


def _is_client_error(err: InferenceServerException) -> bool:
    return str(err.status()) in ("StatusCode.INVALID_ARGUMENT", "400")


def _run_client(index: int, serve: sp.Serve, sequences, expected, healing: bool) -> Tally:
    """One client: REQUESTS_PER_CLIENT requests, every fourth one invalid."""
    protocol = "grpc" if index % 2 else "http"
    module, client = _client(protocol, serve)
    tally = Tally()
    invalid = list(INVALID.items())
    try:
        for n in range(REQUESTS_PER_CLIENT):
            if n % 4 == 3:
                problem, bad = invalid[(index + n) % len(invalid)]
                try:
                    _send(module, client, bad)
                    tally.misreported.append(f"{protocol}: {problem}: answered")
                except InferenceServerException as err:
                    # While a model is reloaded any request may fail (a dead stub, an unloaded model).
                    if _is_client_error(err) or healing:
                        tally.refused += 1
                    else:
                        tally.misreported.append(f"{protocol}: {problem}: {err.status()} {err.message()}")
                except OSError as err:  # HTTP's connection refused or reset: the server itself went away
                    if healing:
                        tally.refused += 1
                    else:
                        tally.misreported.append(f"{protocol}: {problem}: {type(err).__name__}: {err}")
                continue
            sequence = sequences[(index * REQUESTS_PER_CLIENT + n) % len(sequences)]
            try:
                answer = _send(module, client, sequence)
            except InferenceServerException as err:
                tally.failed.append(f"{protocol}: {err.status()} {err.message()}"[:300])
                continue
            except OSError as err:  # HTTP's connection refused or reset (gRPC says UNAVAILABLE, above)
                tally.failed.append(f"{protocol}: {type(err).__name__}: {err}"[:300])
                continue
            if np.allclose(answer, expected[sequence], atol=1e-4, rtol=1e-4):
                tally.correct += 1
            else:
                tally.wrong.append((protocol, sequence, float(np.abs(answer - expected[sequence]).max())))
    finally:
        client.close()
    return tally


def _round(serve: sp.Serve, sequences, expected, healing: bool = False) -> Tally:
    total = Tally()
    with ThreadPoolExecutor(CLIENTS) as pool:
        for tally in pool.map(lambda i: _run_client(i, serve, sequences, expected, healing), range(CLIENTS)):
            total.add(tally)
    return total


def _server_rss_mb(serve: sp.Serve) -> float:
    """Resident memory of tritonserver and every stub it runs, MiB."""
    server = sp.tritonserver_of(serve.process.pid)
    return sum(procfs.memory_bytes(pid) for pid in [server, *sp.stubs(server)]) / 2**20


def test_load_mixed_valid_and_invalid_requests_over_http_and_grpc(served, sequences, expected):
    valid = CLIENTS * REQUESTS_PER_CLIENT * 3 // 4
    rounds, memory = [], []
    for _ in range(3):  # the first round warms up (arenas, caches); memory is compared after the next two
        tally = _round(served, sequences, expected)
        rounds.append(tally)
        memory.append(_server_rss_mb(served))
    for tally in rounds:
        assert not tally.wrong, f"wrong answers: {tally.wrong[:5]}"
        assert not tally.failed, f"valid requests failed: {tally.failed[:5]}"
        assert not tally.misreported, f"invalid requests not refused as the client's: {tally.misreported[:5]}"
        assert tally.correct == valid and tally.refused == CLIENTS * REQUESTS_PER_CLIENT - valid  # none lost
    # Flat: the third round ends within 10% (+ 50 MiB of allocator slack) of the second.
    assert memory[2] <= memory[1] * 1.10 + 50, f"server memory grew: {memory} MiB"
    print(f"memory after each round: {[round(m) for m in memory]} MiB")


OVERLOAD_CLIENTS = 120
OVERLOAD_SECONDS = 4  # two of the supervisor's probes (every 2 s) fall inside each round


def _overload_round(serve: sp.Serve, batch: list[str], expected_row: np.ndarray) -> tuple[list[str], list[float]]:
    """OVERLOAD_CLIENTS clients (half HTTP, half gRPC) sending full batches back to back for
    OVERLOAD_SECONDS; each outcome is "ok", "wrong", "busy" (turned away by admission control) or
    the error; and the latency of every answer."""
    outcomes: list[str] = []
    latencies: list[float] = []

    def one(index: int) -> None:
        protocol = "grpc" if index % 2 else "http"
        module, client = _client(protocol, serve)
        deadline = time.monotonic() + OVERLOAD_SECONDS
        try:
            while time.monotonic() < deadline:
                tensor = module.InferInput("sequences", [len(batch), 1], "BYTES")
                tensor.set_data_from_numpy(np.array([[s.encode()] for s in batch], dtype=np.object_))
                kwargs: dict[str, Any] = {"client_timeout": 120} if module is grpcclient else {}
                sent = time.monotonic()
                try:
                    result = client.infer(f"{NAME}_embeddings", [tensor], **kwargs)
                    rows = None if result is None else result.as_numpy("embeddings")
                except InferenceServerException as err:
                    text = f"{err.status()} {err.message()}"
                    outcomes.append("busy" if any(m in text for m in TURNED_AWAY) else f"{protocol}: {text}"[:300])
                    continue
                latencies.append(time.monotonic() - sent)
                right = rows is not None and np.allclose(rows, expected_row, atol=1e-4, rtol=1e-4)
                outcomes.append("ok" if right else "wrong")
        finally:
            client.close()

    with ThreadPoolExecutor(OVERLOAD_CLIENTS) as pool:
        list(pool.map(one, range(OVERLOAD_CLIENTS)))
    return outcomes, latencies


def test_overload_is_turned_away_never_failed_and_no_stub_is_killed(served, sequences, expected):
    """Finding: 110 clients sending valid maximum-size batches got 67 of 207 requests failed, the
    supervisor having killed the busy stubs. Now: 120 clients, two rounds; every request is answered
    right or turned away by admission control, no model is reloaded, no stub replaced, and the
    server's memory after the second round is within 10% (+ 50 MiB) of the first."""
    server = sp.tritonserver_of(served.process.pid)
    stubs = sorted(sp.stubs(server))
    earlier = len(served.text())
    batch = [sequences[0]] * 8  # max_batch_size rows
    memory, rounds = [], []
    for _ in range(2):
        rounds.append(_overload_round(served, batch, expected[sequences[0]]))
        memory.append(_server_rss_mb(served))
    log = served.text()[earlier:]
    for outcomes, _ in rounds:
        others = [o for o in outcomes if o not in ("ok", "busy")]
        assert outcomes.count("ok") and not others, others[:5]
    assert "health: reloaded" not in log and "does not answer" not in log, log
    assert sp.tritonserver_of(served.process.pid) == server and sorted(sp.stubs(server)) == stubs
    assert memory[1] <= memory[0] * 1.10 + 50, f"server memory grew: {memory} MiB"
    for outcomes, latencies in rounds:
        print(f"{len(outcomes)} requests: {outcomes.count('ok')} right, {outcomes.count('busy')} turned away; "
              f"p50 {np.percentile(latencies, 50):.2f} s, max {max(latencies):.2f} s")
    print(f"memory after each round: {[round(m) for m in memory]} MiB")


def test_a_stub_killed_under_load_heals_without_wrong_answers(served, sequences, expected):
    """Rounds of load run back to back while both encoder stubs are killed: requests fail while the
    supervisor reloads the encoder (never with a wrong answer), then answers are right again
    within a minute and every request of the next round is right. The same tritonserver answers,
    unless it aborted on the dead stub's lock (seen in a CI run, and in one of three runs of this
    module under a 0.4-core quota): then `serve` must have said so and restarted it."""
    server = sp.tritonserver_of(served.process.pid)
    earlier = len(served.text())
    stop = threading.Event()

    def load() -> Tally:
        total = Tally()
        while not stop.is_set():
            total.add(_round(served, sequences, expected, healing=True))
        return total

    with ThreadPoolExecutor(1) as background:
        running = background.submit(load)
        time.sleep(1.0)  # the clients are sending
        stubs = sp.stubs(server, f"{NAME}_encoder")
        for stub in stubs:
            os.kill(stub, signal.SIGKILL)
        killed = time.monotonic()
        assert not sp.wait_gone(stubs, 10)
        module, client = _client("grpc", served)
        try:
            while True:  # until the model answers again, right
                try:
                    answer = _send(module, client, sequences[0])
                    if time.monotonic() - killed > 1.0:
                        break
                except InferenceServerException:
                    pass
                assert time.monotonic() - killed < HEAL_SECONDS, f"not healed:\n{served.text()}"
                time.sleep(0.2)
        finally:
            client.close()
        healed = time.monotonic() - killed
        time.sleep(1.0)  # the load goes on against the healed model for a while
        stop.set()
        during = running.result(timeout=600)
    log = served.text()[earlier:]
    restarted = sp.tritonserver_of(served.process.pid) != server
    if restarted:  # only for the abort the module's docstring describes, and said by serve
        assert "tritonserver exited unexpectedly" in log and "lock_exception" in log, log[-4000:]
    np.testing.assert_allclose(answer, expected[sequences[0]], atol=1e-4, rtol=1e-4)
    assert during.failed, "no request failed: the stubs were killed after the load"
    assert not during.wrong, f"wrong answers while healing: {during.wrong[:5]}"
    assert not during.misreported, (during.misreported[:5], log[-4000:])
    after = _round(served, sequences, expected)
    assert after.correct == CLIENTS * REQUESTS_PER_CLIENT * 3 // 4 and not after.wrong and not after.failed
    by = "a restarted tritonserver" if restarted else "the same tritonserver"
    print(f"healed {healed:.1f} s after the kill ({by}); "
          f"meanwhile {during.correct} right answers, {len(during.failed)} failed requests, none wrong")
