"""Several servers of the same repository used as one client, so that a job never loses a record
and never lists one as bad for a failure of the server's.

    with ServerPool(["grpc://a:8001", "grpc://b:8001"], concurrency=4) as pool:
        results = infer_rows(pool, "esm2nv_embeddings", count, make_inputs)   # as with one TritonClient

- Work goes to the server with the fewest requests in flight: a faster server finishes sooner and
  so gets more.
- A request the server fails for a reason of its own is sent again, never reported as the
  request's fault (client/triton.py's Failure says which is which):
  - turned away for load (admission control: ServerBusyError) -> sent again after a backoff, on
    whichever server is then least loaded;
  - the server cannot be reached (it died, its connection dropped) or does not serve the model now
    (ModelNotServedError: shutting down, serve reloading it) -> that server is set aside for
    `down_for_s` and the request moved to another;
  - any other failure of the server's (ServerFailedError: no answer within the deadline, a dead
    Python-backend stub, ...) -> that server is set aside for the backoff, and the request sent to
    another, or to the same one once the backoff has passed.
  The backoff doubles from `backoff_s` up to `max_backoff_s`, each wait drawn between half and all
  of it (jitter: the requests of a window that failed together are not all sent again at once).
  A request still failing `give_up_s` after its first failure ends the run with
  ServerUnreachableError naming every server and what it answered last.
- `statistics` counts the retries of each kind; `on_retry(kind, server, message)` is told of each
  as it happens (kind: "busy", "moved" or "transient"), for a progress line.
- A request the server refuses for what it holds (an invalid character, too long) raises
  InferenceError as from one client: that is the record's fault, not the server's.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np

from .triton import (
    ModelNotServedError,
    Pending,
    ServerBusyError,
    ServerFailedError,
    ServerUnreachableError,
    TritonClient,
    server_words,
)

T = TypeVar("T")

RetryKind = Literal["busy", "moved", "transient"]
"""What a request was sent again after: turned away for load, a server unreachable or not serving
the model (the request moved), another failure of the server's."""

OnRetry = Callable[[RetryKind, str, str], None]
"""Told of each retry as it happens: (kind, the URL of the server that failed, its message)."""


@dataclass
class PoolStatistics:
    """What the pool did, for a job's final account."""

    answered: list[int]
    """Requests answered by each server, in the order of the URLs."""
    busy_retries: int = 0
    """Requests sent again after a server turned them away for load."""
    moved: int = 0
    """Requests sent to another server after theirs could not be reached or did not serve the model."""
    transient_retries: int = 0
    """Requests sent again after a server failed them for a reason of its own (ServerFailedError: no
    answer within the deadline, a dead Python-backend stub, ...)."""


class ServerPool:
    """`submit`, `max_batch_size` and `model_config` as TritonClient has them, over several servers."""

    def __init__(self, urls: Sequence[str], *, concurrency: int = 1, backoff_s: float = 0.2,
                 max_backoff_s: float = 10.0, down_for_s: float = 5.0, give_up_s: float = 300.0,
                 on_retry: OnRetry | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, jitter: Callable[[], float] = random.random,
                 client: Callable[..., TritonClient] = TritonClient) -> None:
        if not urls:
            raise ValueError("give at least one server URL")
        self.clients = [client(url, concurrency=concurrency) for url in urls]
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.down_for_s, self.give_up_s = down_for_s, give_up_s
        self.on_retry = on_retry
        self.clock, self.sleep, self.jitter = clock, sleep, jitter
        self.in_flight = [0] * len(urls)
        self.down_until = [0.0] * len(urls)
        self.last_failure: list[str | None] = [None] * len(urls)
        """What each server answered to the last request it failed, for the message of a give-up."""
        self.statistics = PoolStatistics(answered=[0] * len(urls))
        self._lock = threading.Lock()

    # -- what infer_rows and jobs use -----------------------------------------------------------------
    def submit(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str] | None = None) -> Pending:
        return _PoolRequest(self, model, inputs, outputs)

    def max_batch_size(self, model: str) -> int:
        return self._first_answer(lambda client: client.max_batch_size(model))

    def model_config(self, model: str) -> dict:
        return self._first_answer(lambda client: client.model_config(model))

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- choosing and setting aside servers -----------------------------------------------------------
    def _first_answer(self, ask: Callable[[TritonClient], T]) -> T:
        """The first server's answer that can give it; a model no server serves raises the first
        ModelNotServedError (its name is the caller's to judge), anything else ServerUnreachableError."""
        errors: list[Exception] = []
        for client in self.clients:
            try:
                return ask(client)
            except (ServerUnreachableError, ServerFailedError) as err:
                errors.append(err)
        not_served = [err for err in errors if isinstance(err, ModelNotServedError)]
        if not_served:
            raise not_served[0]
        raise ServerUnreachableError("no server answers: " + "; ".join(map(str, errors)))

    def _send(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str] | None,
              give_up_at: float) -> tuple[int, Pending]:
        """Submit to the least loaded server that is up; wait while every server is set aside, until
        `give_up_at`. A submit that fails at once comes back as a request that fails at `result()`."""
        while True:
            now = self.clock()
            with self._lock:
                up = [i for i in range(len(self.clients)) if self.down_until[i] <= now]
                chosen = min(up, key=lambda i: self.in_flight[i]) if up else None
                if chosen is not None:
                    self.in_flight[chosen] += 1
            if chosen is not None:
                break
            if now >= give_up_at:
                raise self._given_up(model)
            self.sleep(max(0.05, min(min(self.down_until), give_up_at) - now))
        try:
            return chosen, self.clients[chosen].submit(model, inputs, outputs)
        except (ServerUnreachableError, ServerFailedError) as err:
            return chosen, _Failed(err)

    def _answered(self, index: int) -> None:
        with self._lock:
            self.in_flight[index] -= 1
            self.statistics.answered[index] += 1

    def _failed(self, index: int, message: str, set_aside_s: float) -> None:
        with self._lock:
            self.in_flight[index] -= 1
            self.last_failure[index] = message
            if set_aside_s > 0:
                self.down_until[index] = max(self.down_until[index], self.clock() + set_aside_s)

    def _retried(self, index: int, kind: RetryKind, message: str) -> None:
        with self._lock:
            if kind == "busy":
                self.statistics.busy_retries += 1
            elif kind == "moved":
                self.statistics.moved += 1
            else:
                self.statistics.transient_retries += 1
        if self.on_retry is not None:
            self.on_retry(kind, str(self.clients[index].url), message)

    def _given_up(self, model: str) -> ServerUnreachableError:
        last = "; ".join(f"{client.url}: {' '.join(failure.split()) if failure else 'no failure'}"
                         for client, failure in zip(self.clients, self.last_failure))
        return ServerUnreachableError(
            f"{model}: a request failed on every try for {self.give_up_s:g} s, for the servers' reasons, not its "
            f"own (last answers: {last}); check the servers (bionemo-export health URL) and run again: a job "
            "resumes where it stopped")


class _Failed:
    """A request whose submit failed at once: `result()` raises that failure."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def result(self) -> dict[str, np.ndarray]:
        raise self.error


class _PoolRequest:
    """One request: sent at once; at `result()`, sent again (after a backoff, or elsewhere) for as
    long as servers fail it for their own reasons, up to `give_up_s` after its first failure."""

    def __init__(self, pool: ServerPool, model: str, inputs: dict[str, np.ndarray], outputs: list[str] | None):
        self.pool, self.model, self.inputs, self.outputs = pool, model, inputs, outputs
        self.backoff = pool.backoff_s
        self.failing_since: float | None = None
        self.server, self.pending = pool._send(model, inputs, outputs, pool.clock() + pool.give_up_s)

    def result(self) -> dict[str, np.ndarray]:
        while True:
            try:
                answer = self.pending.result()
            except (ServerUnreachableError, ServerFailedError) as err:
                self._failed(err)
            except BaseException:  # the request's own fault (InferenceError), or an interrupt
                self.pool._answered(self.server)
                raise
            else:
                self.pool._answered(self.server)
                return answer
            assert self.failing_since is not None  # set by _failed
            self.server, self.pending = self.pool._send(self.model, self.inputs, self.outputs,
                                                        self.failing_since + self.pool.give_up_s)

    def _failed(self, err: ServerUnreachableError | ServerFailedError) -> None:
        """Account for a failure of the server's and wait as its kind asks; raise once the request
        has failed for give_up_s."""
        pool, message = self.pool, server_words(err)
        now = pool.clock()
        if self.failing_since is None:
            self.failing_since = now
        wait = self.backoff * (0.5 + 0.5 * pool.jitter())
        self.backoff = min(2 * self.backoff, pool.max_backoff_s)
        kind: RetryKind
        if isinstance(err, ServerBusyError):
            kind, set_aside = "busy", 0.0  # the server is well, only full: no reason to avoid it
        elif isinstance(err, (ServerUnreachableError, ModelNotServedError)):
            kind, set_aside = "moved", pool.down_for_s
        else:
            kind, set_aside = "transient", wait
        pool._failed(self.server, message, set_aside)
        if now - self.failing_since >= pool.give_up_s:
            raise pool._given_up(self.model) from err
        pool._retried(self.server, kind, message)
        if kind == "busy":
            pool.sleep(wait)
