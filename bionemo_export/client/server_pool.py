"""Several servers of the same repository used as one client, so that a job never loses a record.

    with ServerPool(["grpc://a:8001", "grpc://b:8001"], concurrency=4) as pool:
        results = infer_rows(pool, "esm2nv_embeddings", count, make_inputs)   # as with one TritonClient

- Work goes to the server with the fewest requests in flight: a faster server finishes sooner and
  so gets more.
- A server that turns a request away for load (admission control: UNAVAILABLE / HTTP 503,
  ServerBusyError) gets the request back after a backoff (doubling from `backoff_s` up to
  `max_backoff_s`), on whichever server is then least loaded.
- A server that cannot be reached (it died, its connection dropped) or that does not serve the
  model now (ModelNotServedError: it is shutting down and has unloaded it, or serve is reloading
  it) is set aside for `down_for_s`; its requests go to the others. With every server down, the pool waits for one
  until `give_up_s` has passed since the last answer, then raises ServerUnreachableError.
- A request the server refuses for what it holds (an invalid character, too long) raises
  InferenceError as from one client: that is the record's fault, not the server's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from .triton import ModelNotServedError, Pending, ServerBusyError, ServerUnreachableError, TritonClient

T = TypeVar("T")


@dataclass
class PoolStatistics:
    """What the pool did, for a job's final account."""

    answered: list[int]
    """Requests answered by each server, in the order of the URLs."""
    busy_retries: int = 0
    """Requests sent again after a server turned them away for load."""
    moved: int = 0
    """Requests sent to another server after theirs could not be reached."""


class ServerPool:
    """`submit` and `max_batch_size` as TritonClient has them, over several servers."""

    def __init__(self, urls: Sequence[str], *, concurrency: int = 1, backoff_s: float = 0.2,
                 max_backoff_s: float = 10.0, down_for_s: float = 5.0, give_up_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 client: Callable[..., TritonClient] = TritonClient) -> None:
        if not urls:
            raise ValueError("give at least one server URL")
        self.clients = [client(url, concurrency=concurrency) for url in urls]
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.down_for_s, self.give_up_s = down_for_s, give_up_s
        self.clock, self.sleep = clock, sleep
        self.in_flight = [0] * len(urls)
        self.down_until = [0.0] * len(urls)
        self.statistics = PoolStatistics(answered=[0] * len(urls))
        self.last_answer = clock()
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
        errors = []
        for client in self.clients:
            try:
                return ask(client)
            except ServerUnreachableError as err:
                errors.append(str(err))
        raise ServerUnreachableError("no server answers: " + "; ".join(errors))

    def _send(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str] | None) -> tuple[int, Pending]:
        """Submit to the least loaded server that is up; wait while every server is down."""
        while True:
            now = self.clock()
            with self._lock:
                up = [i for i in range(len(self.clients)) if self.down_until[i] <= now]
                chosen = min(up, key=lambda i: self.in_flight[i]) if up else None
                if chosen is not None:
                    self.in_flight[chosen] += 1
            if chosen is None:
                if now - self.last_answer > self.give_up_s:
                    raise ServerUnreachableError(f"no server has answered for {self.give_up_s:.0f} s: "
                                                 + ", ".join(str(c.url) for c in self.clients))
                self.sleep(max(0.05, min(self.down_until) - now))
                continue
            try:
                return chosen, self.clients[chosen].submit(model, inputs, outputs)
            except ServerUnreachableError:
                self._unreachable(chosen)

    def _answered(self, index: int) -> None:
        with self._lock:
            self.in_flight[index] -= 1
            self.statistics.answered[index] += 1
            self.last_answer = self.clock()

    def _busy(self, index: int) -> None:
        with self._lock:
            self.in_flight[index] -= 1
            self.statistics.busy_retries += 1

    def _unreachable(self, index: int) -> None:
        with self._lock:
            self.in_flight[index] -= 1
            self.down_until[index] = self.clock() + self.down_for_s
            self.statistics.moved += 1


class _PoolRequest:
    """One request: sent at once; at `result()`, sent again (after a backoff, or elsewhere) for as
    long as servers turn it away for load or cannot be reached."""

    def __init__(self, pool: ServerPool, model: str, inputs: dict[str, np.ndarray], outputs: list[str] | None):
        self.pool, self.model, self.inputs, self.outputs = pool, model, inputs, outputs
        self.server, self.pending = pool._send(model, inputs, outputs)

    def result(self) -> dict[str, np.ndarray]:
        backoff = self.pool.backoff_s
        while True:
            try:
                answer = self.pending.result()
            except ServerBusyError:
                self.pool._busy(self.server)
                self.pool.sleep(backoff)
                backoff = min(2 * backoff, self.pool.max_backoff_s)
            except (ServerUnreachableError, ModelNotServedError):
                self.pool._unreachable(self.server)
            except BaseException:  # the request's own fault (InferenceError), or an interrupt
                self.pool._answered(self.server)
                raise
            else:
                self.pool._answered(self.server)
                return answer
            self.server, self.pending = self.pool._send(self.model, self.inputs, self.outputs)
