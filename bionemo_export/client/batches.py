"""Many rows through one model: split into requests of at most the model's max_batch_size, keep
several in flight, put the answers back together in the caller's order.

`infer_rows` is the one engine behind the Python client (bionemo_export.client.RepositoryClient)
and the `client` commands. A request the server refuses for what it holds either ends the run
(InferenceError, the server's message with the rows it covered) or, with `isolate=True`, is sent
again one row at a time so that only the rows the server refuses alone are reported
(`RowResults.failures`) and the others are kept.

A request the server failed for a reason of its own (ServerFailedError: a deadline, a dead stub, a
server shutting down; ServerUnreachableError) is never a row's failure: it ends the run, isolate
or not. Through a ServerPool it has already been sent again for as long as the pool allows; one
TritonClient raises it at once.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from bionemo_export.errors import InvalidInputError
from bionemo_export.serving.batching import stack_padded

from .triton import InferenceError, Inferrer, ServerFailedError

DEFAULT_IN_FLIGHT = 4
"""Requests kept in flight: enough to keep a server's instances and dynamic batcher busy while
the client packs the next request and unpacks the last."""

MakeInputs = Callable[[np.ndarray, int], dict[str, np.ndarray]]
"""(row indices of one request, that request's index) -> the request's input tensors."""


@dataclass
class RowResults:
    """What came back for the rows that succeeded, in the caller's order."""

    rows: np.ndarray
    """The indices of the rows that succeeded, ascending."""
    outputs: dict[str, np.ndarray]
    """Output name -> [len(rows), ...]: requests' outputs joined, padded where lengths differ."""
    failures: list[tuple[int, str]] = field(default_factory=list)
    """(row, the server's message) for each row the server refused alone (isolate=True)."""


def plan_requests(count: int, batch_size: int, order: np.ndarray | None = None) -> list[np.ndarray]:
    """Row indices of each request: consecutive runs of at most `batch_size` rows of `order` (a
    permutation of the `count` rows; None: as given)."""
    if batch_size < 1:
        raise InvalidInputError(f"batch size must be at least 1, got {batch_size}")
    rows = np.arange(count) if order is None else np.asarray(order, dtype=np.int64)
    if len(rows) != count or not np.array_equal(np.sort(rows), np.arange(count)):
        raise ValueError(f"order must be a permutation of the {count} rows")
    return [rows[start:start + batch_size] for start in range(0, count, batch_size)]


def row_ranges(rows: np.ndarray) -> str:
    """Row indices as ascending runs: [7, 3, 4, 5, 9] -> "3-5, 7, 9"."""
    ordered = np.sort(np.asarray(rows))
    breaks = np.flatnonzero(np.diff(ordered) != 1) + 1
    runs = np.split(ordered, breaks)
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)


def batch_size_for(client: Inferrer, model: str, requested: int | None = None) -> int:
    """Rows per request: `requested`, else the model's max_batch_size read from the server; a
    request over the model's max_batch_size is refused here (the server would refuse each one)."""
    limit = client.max_batch_size(model)
    if requested is None:
        return limit or 2**31 - 1  # 0: the model batches nothing itself; send everything at once
    if requested < 1:
        raise InvalidInputError(f"batch size must be at least 1, got {requested}")
    if limit and requested > limit:
        raise InvalidInputError(f"batch size {requested} is over {model}'s max_batch_size {limit}")
    return requested


def in_order(client: Inferrer, model: str, requests: Iterable[dict[str, np.ndarray]], outputs: list[str] | None,
             in_flight: int) -> Iterator[dict[str, np.ndarray] | InferenceError]:
    """Send `requests` with at most `in_flight` awaiting an answer; yield each answer (or the
    InferenceError it got for what it holds) in the order of `requests`. The server's own failures
    (ServerFailedError, ServerUnreachableError) raise."""
    pending: deque = deque()
    for inputs in requests:
        if len(pending) >= max(1, in_flight):
            yield _answer(pending.popleft())
        pending.append(client.submit(model, inputs, outputs))
    while pending:
        yield _answer(pending.popleft())


def _answer(future) -> dict[str, np.ndarray] | InferenceError:
    try:
        return future.result()
    except ServerFailedError:
        raise  # the server's failure, not the rows': sending them one by one would list them as bad
    except InferenceError as err:
        return err


def infer_rows(client: Inferrer, model: str, count: int, make_inputs: MakeInputs, *,
               outputs: list[str] | None = None, batch_size: int | None = None,
               in_flight: int = DEFAULT_IN_FLIGHT, isolate: bool = False, stop_on_failure: bool = False,
               progress: Callable[[int], None] | None = None, order: np.ndarray | None = None) -> RowResults:
    """Run `count` rows through `model` in requests of `batch_size` rows (default: the model's
    max_batch_size), `in_flight` at a time. `make_inputs(rows, index)` builds request `index`'s
    inputs for its `rows`; `progress(n)` is told each time n more rows are done. `order`: the rows
    in the order they are sent (a permutation; None: as given); the results are in the caller's
    order whatever it is. The Python client sends sequences sorted by length, so that a request's
    rows share the server's length buckets (serving/batching.py) instead of each request spanning
    all of them.

    A request refused for what it holds raises InferenceError naming its rows (when there were
    several requests), unless `isolate`: then its rows are sent one by one and those refused alone
    are listed in `failures` with the server's message; `stop_on_failure` ends the run at the first
    such row (the rows after it are left out of the results). A failure of the server's own
    (ServerFailedError, ServerUnreachableError), of a request or of a row sent alone, raises: it is
    never listed as a row's."""
    size = batch_size_for(client, model, batch_size)
    if order is not None and stop_on_failure:
        raise ValueError("stop_on_failure keeps the rows before the first refused one: send them in their order")
    plan = plan_requests(count, size, order)
    pieces: list[tuple[np.ndarray, dict[str, np.ndarray]]] = []
    failures: list[tuple[int, str]] = []
    # A generator: each request is packed just before it is sent, not all of them up front.
    answers = in_order(client, model, (make_inputs(rows, index) for index, rows in enumerate(plan)), outputs,
                       in_flight)
    for index, (rows, answer) in enumerate(zip(plan, answers)):
        if isinstance(answer, InferenceError):
            if not isolate:
                where = f" (rows {row_ranges(rows)} of {count}, sent as one request)" if len(plan) > 1 else ""
                raise type(answer)(f"{answer}{where}") from answer
            good, bad = _one_by_one(client, model, rows, make_inputs, index, outputs, in_flight)
            if bad and stop_on_failure:
                pieces += [(single, answer) for single, answer in good if single[0] < bad[0][0]]
                return _join(pieces, bad[:1], outputs)
            pieces += good
            failures += bad
        else:
            pieces.append((rows, answer))
        if progress is not None:
            progress(len(rows))
    return _join(pieces, failures, outputs)


def answered_together(results: Sequence[RowResults]) -> list[RowResults]:
    """Answers of several models for the same rows (a bulk job's encoder and N_contacts), each
    kept to the rows every model answered, in the same order; a row any model refused is a
    failure of each, with the first model's message that refused it (rows ascending)."""
    kept = functools.reduce(np.intersect1d, [result.rows for result in results])
    failures: dict[int, str] = {}
    for result in results:
        for row, message in result.failures:
            failures.setdefault(row, message)
    listed = sorted(failures.items())
    together = []
    for result in results:
        positions = np.searchsorted(result.rows, kept)
        together.append(RowResults(kept, {name: value[positions] for name, value in result.outputs.items()}, listed))
    return together


def _one_by_one(client: Inferrer, model: str, rows: np.ndarray, make_inputs: MakeInputs, index: int,
                outputs: list[str] | None, in_flight: int):
    """The rows of refused request `index`, each sent alone (with the request's index, so that
    per-request settings such as a seed stay the same): (answers, failures)."""
    good, bad = [], []
    singles = [rows[i:i + 1] for i in range(len(rows))]
    for single, answer in zip(singles, in_order(client, model, [make_inputs(s, index) for s in singles], outputs,
                                                in_flight)):
        if isinstance(answer, InferenceError):
            bad.append((int(single[0]), _server_message(str(answer), model)))
        else:
            good.append((single, answer))
    return good, bad


def _server_message(message: str, model: str) -> str:
    prefix = f"{model}: "
    return message[len(prefix):] if message.startswith(prefix) else message


def _join(pieces: list[tuple[np.ndarray, dict[str, np.ndarray]]], failures: list[tuple[int, str]],
          outputs: list[str] | None) -> RowResults:
    if not pieces:
        return RowResults(np.zeros(0, dtype=np.int64), {name: np.zeros(0) for name in outputs or ()}, failures)
    rows = np.concatenate([piece_rows for piece_rows, _ in pieces])
    names = list(pieces[0][1])
    # Requests' hidden states are padded to their own longest row: joined, they are padded to the
    # longest of all, which is what one request for every row would have answered.
    joined = {name: _stack([answer[name] for _, answer in pieces]) for name in names}
    if np.any(np.diff(rows) < 0):  # sent in another order than the caller's
        ascending = np.argsort(rows, kind="stable")
        rows, joined = rows[ascending], {name: value[ascending] for name, value in joined.items()}
    return RowResults(rows, joined, sorted(failures))


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    if arrays[0].ndim < 2:
        return np.concatenate(arrays)
    pad = b"" if arrays[0].dtype == np.object_ else 0
    if len({a.shape[2:] for a in arrays}) > 1:  # [rows, L, L] maps: every axis after the rows padded
        shape = tuple(max(sizes) for sizes in zip(*(a.shape[1:] for a in arrays)))
        out = np.full((sum(len(a) for a in arrays), *shape), pad, dtype=arrays[0].dtype)
        start = 0
        for array in arrays:
            out[(slice(start, start + len(array)), *(slice(0, n) for n in array.shape[1:]))] = array
            start += len(array)
        return out
    return stack_padded(arrays, pad)
