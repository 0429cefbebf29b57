"""How a generated model answers failed requests: Triton error codes and messages, the
execute() boundary no exception may cross, the codes of errors its BLS callees answered, and
giving memory back after a large request.

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library. `triton_python_backend_utils` exists only inside a Python-backend stub,
so it is imported when a response is built, never at import time: the logic here imports (and is
unit-tested, tests/helpers/fake_pb_utils.py) without Triton.
"""

from __future__ import annotations

import ctypes
import traceback
from collections.abc import Callable, Sequence
from typing import Any

INTERNAL_MESSAGE = "internal error ({}); the server log has the details"
CANCELLED_MESSAGE = "the request was cancelled"

# How Triton words a refusal by a model's queue policy (bionemo_export/client/triton.py keeps the
# same list for clients).
TURNED_AWAY = ("Exceeds maximum queue size", "Request timeout expired")


def triton() -> Any:
    """The Python backend's `triton_python_backend_utils` (only importable inside a stub)."""
    import triton_python_backend_utils as pb_utils  # pyright: ignore[reportMissingImports] - only in the stub

    return pb_utils


class RequestError(Exception):
    """One request's failure, answered with a Triton error code: INVALID_ARG (the client's input,
    `code` None), CANCELLED, or the code a BLS callee answered with. The message is the client's
    to read."""

    def __init__(self, message: str, code: int | None = None, *, forwarded: bool = False) -> None:
        super().__init__(message)
        # None stands for INVALID_ARG, resolved when answered: pb_utils.TritonError exists only
        # once the stub runs the model, and the dev server raises these without Triton.
        self.code = code
        self.forwarded = forwarded  # a callee's message, passed on as it is (it names the callee)


def cancelled() -> RequestError:
    """The error of a request whose client cancelled it (or whose deadline passed)."""
    return RequestError(CANCELLED_MESSAGE, triton().TritonError.CANCELLED)


class Responder:
    """How one model answers failures: `model_name` starts its messages and server-log lines;
    `client_errors` are the exception types (besides RequestError) that are the client's mistakes:
    the tokenizer's and the decode loop's argument errors."""

    def __init__(self, model_name: str, client_errors: tuple[type[BaseException], ...] = ()) -> None:
        self.model_name = model_name
        self.client_errors = client_errors

    def error_response(self, err: BaseException, prefix: str | None = None) -> Any:
        """The response to a request that failed with `err`; its message starts with `prefix`
        (default: this model's name; "" for none) unless it is a callee's, passed on.

        The client's mistakes come back with their code and message, so Triton counts them as the
        client's (gRPC INVALID_ARGUMENT, HTTP 400). Anything else is this server's failure:
        INTERNAL with a short message, the traceback only in the server log (never file paths or
        code to a client)."""
        pb_utils = triton()
        if isinstance(err, RequestError):
            code = pb_utils.TritonError.INVALID_ARG if err.code is None else err.code
            message = str(err)
        elif isinstance(err, self.client_errors):
            code, message = pb_utils.TritonError.INVALID_ARG, str(err)
        else:
            trace = "".join(traceback.format_exception(type(err), err, err.__traceback__))
            pb_utils.Logger.log_error(f"{self.model_name}: {trace}")
            code, message = pb_utils.TritonError.INTERNAL, INTERNAL_MESSAGE.format(type(err).__name__)
        prefix = self.model_name if prefix is None else prefix
        if prefix and not getattr(err, "forwarded", False):
            message = f"{prefix}: {message}"
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))

    def answer_all(self, requests: Sequence[Any], execute: Callable[[Sequence[Any]], tuple[list, int]]) -> list:
        """The responses of `execute(requests) -> (responses, bytes of work)`, or for every request
        the error that escaped it: the execute() boundary, where no exception may reach Triton (it
        would send the client a traceback). Memory is given back once execute's arrays are gone."""
        try:
            responses, work = execute(requests)
        except Exception as err:  # noqa: BLE001 - every escaping error becomes a clean response
            return [self.error_response(err) for _ in requests]
        release_memory(work)
        return responses


def callee_code(model_name: str, error: Any) -> int:
    """The code of the error (a pb_utils.TritonError) a BLS call to `model_name` (one of this
    repository's models) answered.

    The Python backend (r24.10) hands every BLS error back as INTERNAL, whatever code the callee
    set; so when it says INTERNAL, the code is read back from the message, which the callee wrote
    with Responder.error_response: "<callee>: " + INTERNAL_MESSAGE or CANCELLED_MESSAGE for those
    codes, any other "<callee>: ..." for the client's mistakes. A callee's queue turning the call
    away (admission control: "Exceeds maximum queue size", "Request timeout expired") is
    UNAVAILABLE, as Triton answers it to a client directly. Other messages not in those forms
    (Triton's own: an unloaded or unknown model) stay INTERNAL."""
    codes = triton().TritonError
    code, message = error.code(), error.message()
    if code == codes.INTERNAL and any(marker in message for marker in TURNED_AWAY):
        return codes.UNAVAILABLE
    if code != codes.INTERNAL or not message.startswith(f"{model_name}: "):
        return code
    text = message[len(model_name) + 2:]
    head, tail = INTERNAL_MESSAGE.split("{}")
    if text.startswith(head) and text.endswith(tail):
        return codes.INTERNAL
    if text == CANCELLED_MESSAGE:
        return codes.CANCELLED
    return codes.INVALID_ARG


def input_array(request: Any, name: str) -> Any:
    """Input `name` of a Triton request as a numpy array, or None when the request left it out."""
    tensor = triton().get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def wanted_outputs(request: Any, outputs: Sequence[str]) -> tuple[str, ...]:
    """The outputs this request asked for, in the order of `outputs` (all of them when it named none)."""
    requested = set(request.requested_output_names())
    return tuple(name for name in outputs if name in requested) or tuple(outputs)


def call_model(model_name: str, inputs: dict[str, Any], outputs: Sequence[str]) -> list[Any]:
    """One BLS request to `model_name`; its error is raised as a RequestError with the callee's
    own code and message (a client's mistake stays the client's)."""
    pb_utils = triton()
    request = pb_utils.InferenceRequest(
        model_name=model_name,
        requested_output_names=list(outputs),
        inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()],
    )
    response = request.exec()
    if response.has_error():
        error = response.error()
        raise RequestError(error.message(), callee_code(model_name, error), forwarded=True)
    return [pb_utils.get_output_tensor_by_name(response, name).as_numpy() for name in outputs]


# Freed heap memory stays with the process unless given back: after one large request the stub
# would keep its peak size for good. glibc's malloc_trim(0) returns it (no-op where absent).
try:
    _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):
    _MALLOC_TRIM = None
TRIM_BYTES = 4 << 20
"""Requests whose arrays reached this many bytes are followed by malloc_trim (tens of microseconds)."""


def release_memory(nbytes: int) -> None:
    """Give freed heap memory back to the operating system after a request of `nbytes`."""
    if _MALLOC_TRIM is not None and nbytes >= TRIM_BYTES:
        _MALLOC_TRIM(0)
