"""A bulk job's sequences through its models, answered request by request (client/jobs.py).

`infer_rows` joins every request's answer into one array padded to the longest row, which is what
a caller that wants all rows at once needs; a job writes each record as soon as its answer is
there, so it takes the answers a request at a time (`request_answers`): its memory is the
requests in flight, each padded to its own longest row only, never a chunk padded to the chunk's.

With several models (an encoder and N_contacts), each request asks each model for the same rows,
and a record either refuses is a failure of both (batches.answered_together). A request a model
refuses is sent again a row at a time (infer_rows' isolate), so that only the rows the server
refuses alone fail. A failure of the server's own (a restarting stub, a lost connection, a
deadline: ServerFailedError, ServerUnreachableError, or a message triton.is_transient reads so)
is never a record's: a ServerPool has sent it again already; here it stops the job, nothing is
recorded as bad, and the same command resumes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .batches import MakeInputs, RowResults, answered_together, batch_size_for, in_order, infer_rows, plan_requests
from .triton import InferenceError, Inferrer, ServerFailedError, is_transient


class TransientFailure(ServerFailedError):
    """A row failed alone for the server's sake, not the record's (triton.is_transient); the job
    stops with nothing recorded as bad, and the same command resumes."""


@dataclass
class RequestAnswer:
    """One request's rows as the models answered them."""

    rows: np.ndarray
    """The rows (of the job's sent sequences) every model answered, ascending."""
    outputs: list[dict[str, np.ndarray]]
    """Per model asked, output name -> [len(rows), ...], padded to this request's longest row only."""
    failures: list[tuple[int, str]] = field(default_factory=list)
    """(row, the server's message) of the rows a model refused alone."""


def request_answers(client: Inferrer, asked: Sequence[tuple[str, MakeInputs, list[str] | None]], count: int, *,
                    batch_size: int | None, in_flight: int) -> Iterator[RequestAnswer]:
    """`count` rows through each (model, make_inputs, outputs) of `asked`, in requests of the
    smallest batch size of them, `in_flight` at a time per model; one RequestAnswer per request,
    in order. Raises TransientFailure for a failure that is the server's (see the module)."""
    size = min(batch_size_for(client, model, batch_size) for model, _, _ in asked)
    plan = plan_requests(count, size)
    streams = [in_order(client, model, _requests(make, plan), outputs, in_flight) for model, make, outputs in asked]
    for index, rows in enumerate(plan):
        answers = [next(stream) for stream in streams]
        if not any(isinstance(answer, InferenceError) for answer in answers):
            yield RequestAnswer(rows, [answer for answer in answers if not isinstance(answer, InferenceError)])
            continue
        results = []
        for (model, make, outputs), answer in zip(asked, answers, strict=True):
            if not isinstance(answer, InferenceError):
                results.append(RowResults(np.arange(len(rows)), answer))
                continue
            _stop_if_transient(model, str(answer))
            def alone(picked: np.ndarray, _: int, make: MakeInputs = make, rows: np.ndarray = rows,
                      index: int = index) -> dict[str, np.ndarray]:
                return make(rows[picked], index)  # with the request's index: per-request settings stay

            results.append(infer_rows(client, model, len(rows), alone, outputs=outputs, batch_size=1,
                                      in_flight=in_flight, isolate=True))
        together = answered_together(results)
        failures = [(int(rows[row]), message) for row, message in together[0].failures]
        for _, message in failures:
            _stop_if_transient(asked[0][0], message)
        yield RequestAnswer(rows[together[0].rows], [result.outputs for result in together], failures)


def _requests(make: MakeInputs, plan: list[np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
    """Each request's inputs, packed just before it is sent."""
    for index, rows in enumerate(plan):
        yield make(rows, index)


def _stop_if_transient(model: str, message: str) -> None:
    if is_transient(message):
        raise TransientFailure(f"{model}: the server failed a request for its own sake ({message.strip()}), after "
                               "its retries; nothing was recorded as a bad record. Rerun the same command once the "
                               "server is healthy: it resumes where this run stopped")
