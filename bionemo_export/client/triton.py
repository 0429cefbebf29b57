"""A small tritonclient wrapper: one URL string picks HTTP or gRPC, and results come back as numpy.

URLs follow BioNeMo's clients: `http://host:8000` (the default), `grpc://host:8001`, or a bare
`host:port` (HTTP).

`submit` sends a request without waiting for its answer (tritonclient's own asynchronous calls:
gRPC futures, HTTP greenlets), so that a caller can keep several requests in flight from one
thread; `infer` is `submit(...).result()`.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from http.client import HTTPException
from typing import Any, Protocol, TypeVar

import numpy as np

from bionemo_export.errors import InvalidInputError, UserError

DEFAULT_URL = "http://localhost:8000"

GRPC_MAX_MESSAGE_BYTES = 2**31 - 1
"""gRPC's limit on one message, both ways: gRPC's own default is 4 MiB, which the hidden states of a
few long sequences exceed (BioNeMo's ESM-2 client raised it to 100 MiB by hand). Triton's server
accepts up to this size."""

MAX_RECONNECT_BACKOFF_MS = 2000
"""The longest a gRPC channel waits between tries to reconnect to its server."""

_NUMPY_TO_TRITON = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32",
                    np.dtype(np.bool_): "BOOL", np.dtype(np.object_): "BYTES", np.dtype(np.float16): "FP16"}


class Pending(Protocol):
    """A request in flight (`TritonClient.submit`): a gRPC Future, or an HTTP request in flight."""

    def result(self) -> dict[str, np.ndarray]:
        """Wait for the outputs; raises InferenceError (ServerFailedError when it was the server's
        failure) or ServerUnreachableError as `infer` does."""
        ...


class Inferrer(Protocol):
    """What runs rows through a model (batches.infer_rows, jobs): one TritonClient, or a
    ServerPool of several servers."""

    def submit(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str] | None = None) -> Pending: ...

    def max_batch_size(self, model: str) -> int: ...

    def model_config(self, model: str) -> dict: ...


Client = TypeVar("Client", bound="TritonClient")


class InferenceError(UserError, RuntimeError):
    """The server refused or failed a request; the message is the server's."""


class ServerFailedError(InferenceError):
    """The server failed a request for a reason of its own, not for what the request holds: no answer
    within the deadline, the model's Python-backend stub died ("Stub process '<instance>' is not
    healthy."), the server shutting down, a 5xx that is not the request's fault. Transient: the same
    request, sent again a little later or to another server, is answered. A ServerPool sends it
    again; a single TritonClient raises it at once."""


class ServerBusyError(ServerFailedError):
    """The server turned the request away under admission control (its queue for the model was full,
    or the request waited past the queue timeout): gRPC UNAVAILABLE, HTTP 503. Retry later, or with
    fewer requests in flight."""


class ModelNotServedError(ServerFailedError):
    """The server answers but does not serve the model now: it is unloading it (tritonserver shutting
    down), reloading it (serve's supervisor healing a stub) or never loaded it. Not the request's
    fault: another server, or the same one a little later, answers it."""


class ServerUnreachableError(UserError, ConnectionError):
    """No Triton server answers at the URL (refused, unresolvable, the connection dropped); the
    message names the URL."""


# -- whose fault a failed request is ------------------------------------------------------------

class Failure(enum.Enum):
    """Whose fault a failed request is, and so what a caller does with it: only REQUEST is the
    request's (a bad record); every other kind is the server's and passes."""

    REQUEST = "request"
    """The request's own (INVALID_ARGUMENT / HTTP 400, a model's named input error, a model failing
    on what it holds): InferenceError."""
    BUSY = "busy"
    """Turned away by the model's queue policy: ServerBusyError."""
    NOT_SERVED = "not served"
    """The server does not serve the model now (unloading or reloading it): ModelNotServedError."""
    UNREACHABLE = "unreachable"
    """Nothing answers, the connection dropped mid-request, or the server is stopping:
    ServerUnreachableError."""
    FAILED = "failed"
    """The server failed it (a deadline, a dead stub, a cancel of its own): ServerFailedError."""


NOT_SERVED = ("Request for unknown model", "does not serve it now")
"""How Triton words a request for a model it has no loaded version of (gRPC NOT_FOUND, HTTP 400):
measured on tritonserver 2.51 while it shut down under load, every request between the unloading
of the model and the closing of the port got it. Then ModelNotServedError's own words."""

TURNED_AWAY = ("Exceeds maximum queue size", "Request timeout expired")
"""How Triton words a rejection by a model's queue policy (its error code is UNAVAILABLE / 503)."""

SERVER_FAILED = (
    # python_backend's dead stub: "Stub process '<instance>' is not healthy." (measured on 2.51, gRPC
    # INTERNAL and HTTP 500), "Stub process is not healthy."; and a stub that died holding its lock
    "is not healthy",
    "Failed to obtain the health mutex",
    "Deadline Exceeded",  # gRPC: no answer within the client's deadline (timeout_s)
    "the request was cancelled",  # serving/responses.py's CANCELLED_MESSAGE (HTTP 400 carries no code)
    "timed out",  # HTTP: no answer within timeout_s (a socket timeout)
    "failed the request, not for what it holds",  # ServerFailedError's own
)
"""Words of failures that are the server's, whatever code carries them: a dead Python-backend stub
answers INTERNAL / HTTP 500, which is otherwise a model failing on what a request holds."""

CONNECTION_LOST = ("Socket closed", "Stream removed", "Connection reset", "Connection refused", "Broken pipe",
                   "failed to connect to all addresses", "connection closed", "cannot reach a Triton server",
                   "Server is stopping", "Server not ready", "Server exiting")
"""Words of a connection that dropped or never opened (gRPC UNAVAILABLE "Stream removed (Socket
closed)" for requests in flight when tritonserver was killed, measured; geventhttpclient's
"connection closed."), of a server on its way out (Triton core's, UNAVAILABLE / 503), and
ServerUnreachableError's own."""

REQUEST_TOO_LARGE = ("larger than max",)
"""gRPC's RESOURCE_EXHAUSTED for a message over the channel's limit: the request's size, not the server's state."""

_CODES = {
    "UNAVAILABLE": Failure.UNREACHABLE, "503": Failure.UNREACHABLE, "502": Failure.UNREACHABLE,
    "DEADLINE_EXCEEDED": Failure.FAILED, "504": Failure.FAILED, "408": Failure.FAILED,
    "CANCELLED": Failure.FAILED, "499": Failure.FAILED,
    "RESOURCE_EXHAUSTED": Failure.FAILED, "429": Failure.FAILED, "ABORTED": Failure.FAILED,
}
"""Codes that are the server's state whatever the message (gRPC's names, HTTP's numbers). INTERNAL /
500 is not among them: Triton answers it for a model that failed on what the request holds (an
onnxruntime backend: "onnx runtime error N: ...", a Python model's exception: serving/responses.py's
"internal error (...)"); a dead stub's INTERNAL is told by its words (SERVER_FAILED)."""


def failure_kind(message: str, status: str | int | None = None) -> Failure:
    """Whose fault a failed request is, from the server's message and, where known, its status
    (tritonclient's `status()`: "StatusCode.DEADLINE_EXCEEDED" over gRPC, "500" over HTTP)."""
    text = str(message)
    if any(marker in text for marker in REQUEST_TOO_LARGE):
        return Failure.REQUEST
    for kind, markers in ((Failure.BUSY, TURNED_AWAY), (Failure.NOT_SERVED, NOT_SERVED),
                          (Failure.FAILED, SERVER_FAILED), (Failure.UNREACHABLE, CONNECTION_LOST)):
        if any(marker in text for marker in markers):
            return kind
    code = "" if status is None else str(status).removeprefix("StatusCode.")
    return _CODES.get(code, Failure.REQUEST)


def is_transient(message: str, status: str | int | None = None) -> bool:
    """Whether a failed request was the server's passing state rather than the request's fault:
    sent again, it is answered. Works on a message alone (an error recorded earlier, as an errors
    file or a journal holds it, with or without the model's name before it)."""
    return failure_kind(message, status) is not Failure.REQUEST


@dataclass(frozen=True)
class TritonUrl:
    protocol: str  # "http" or "grpc"
    address: str  # host:port

    @classmethod
    def parse(cls, url: str) -> TritonUrl:
        for protocol in ("http", "grpc"):
            prefix = f"{protocol}://"
            if url.startswith(prefix):
                return cls(protocol, url[len(prefix):].rstrip("/"))
        if "://" in url:
            raise InvalidInputError(f"unsupported URL scheme in {url!r}: use http://host:port or grpc://host:port")
        return cls("http", url)

    def __str__(self) -> str:
        return f"{self.protocol}://{self.address}"


def strings_to_tensor(sequences: list[str] | tuple[str, ...]) -> np.ndarray:
    """Sequences as Triton expects them: UTF-8 bytes in an object array of shape [batch, 1]."""
    return np.array([[s.encode("utf-8")] for s in sequences], dtype=np.object_).reshape(len(sequences), 1)


def grpc_channel_args() -> list[tuple[str, int]]:
    """The gRPC channel options of every client: message limits raised to GRPC_MAX_MESSAGE_BYTES
    (whatever the installed tritonclient defaults to; older ones kept gRPC's 4 MiB),
    tritonclient's keepalive defaults, which passing `channel_args` would otherwise drop, and a
    reconnect backoff bounded by MAX_RECONNECT_BACKOFF_MS."""
    from tritonclient.grpc import KeepAliveOptions

    keepalive = KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        # gRPC waits up to 120 s (growing 1.6x from 1 s) between tries to reconnect to a server that
        # went away, and fails requests at once meanwhile: a server restarted on its ports would be
        # seen up to two minutes late.
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]


class TritonClient:
    """Run inference on one server over HTTP or gRPC, read its view of its models (configuration,
    metadata, readiness, the repository index, statistics) and load and unload them: the package's
    one Triton client (serve's supervisor, health, bench, tune and the clients use it).

    `concurrency` bounds the HTTP requests in flight at once (gRPC has no such bound)."""

    def __init__(self, url: str = DEFAULT_URL, *, timeout_s: float = 300.0, concurrency: int = 1) -> None:
        self.url = TritonUrl.parse(url)
        self.timeout_s = timeout_s
        if self.url.protocol == "grpc":
            import tritonclient.grpc as module

            kwargs: dict[str, Any] = {"channel_args": grpc_channel_args()}
        else:
            import tritonclient.http as module

            kwargs = {"network_timeout": timeout_s, "connection_timeout": timeout_s,
                      "concurrency": max(1, concurrency)}
        self._module: Any = module
        # tritonclient's gRPC or HTTP client: their calls take protocol-specific arguments.
        self._client: Any = module.InferenceServerClient(self.url.address, **kwargs)
        self._configs: dict[str, dict] = {}

    def infer(self, model: str, inputs: dict[str, np.ndarray],
              outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        """Send `inputs` (name -> array with the batch axis first) to `model`; return the outputs."""
        return self.submit(model, inputs, outputs).result()

    def submit(self, model: str, inputs: dict[str, np.ndarray],
               outputs: list[str] | None = None) -> Pending:
        """Send a request without waiting: `result()` gives `infer`'s answer (or raises
        InferenceError or ServerUnreachableError as `infer` does)."""
        infer_inputs = []
        for name, array in inputs.items():
            dtype = _NUMPY_TO_TRITON.get(array.dtype)
            if dtype is None:
                raise TypeError(f"input {name!r}: unsupported numpy dtype {array.dtype}")
            tensor = self._module.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            infer_inputs.append(tensor)
        requested = [self._module.InferRequestedOutput(name) for name in outputs] if outputs else None
        if self.url.protocol == "grpc":
            return self._submit_grpc(model, infer_inputs, requested, outputs)
        _quiet_connection_errors()
        return _HttpPending(self._guarded(model, lambda: self._client.async_infer(model, infer_inputs,
                                                                                   outputs=requested)),
                            lambda result: self._outputs(result, outputs), self._translate(model))

    def _submit_grpc(self, model: str, infer_inputs: list, requested: list | None,
                     outputs: list[str] | None) -> Future[dict[str, np.ndarray]]:
        future: Future = Future()
        translate = self._translate(model)

        def done(result: Any, error: Exception | None) -> None:  # runs on a gRPC thread
            if error is not None:
                future.set_exception(translate(error))
                return
            try:
                future.set_result(self._outputs(result, outputs))
            except Exception as err:  # noqa: BLE001 - the caller gets it from result()
                future.set_exception(err)

        self._guarded(model, lambda: self._client.async_infer(model, infer_inputs, done, outputs=requested,
                                                              client_timeout=self.timeout_s))
        return future

    def _outputs(self, result: Any, outputs: list[str] | None) -> dict[str, np.ndarray]:
        if outputs is None:
            response = result.get_response(as_json=True) if self.url.protocol == "grpc" else result.get_response()
            outputs = [output["name"] for output in response["outputs"]]
        # A model may leave out outputs asked for (N_layers answers only what `include` names):
        # those are absent here rather than None.
        answered = {name: result.as_numpy(name) for name in outputs}
        return {name: value for name, value in answered.items() if value is not None}

    def _translate(self, model: str) -> Callable[[Exception], Exception]:
        """The function that turns a tritonclient or socket error of a request to `model` into ours."""
        from tritonclient.utils import InferenceServerException

        def translate(err: Exception) -> Exception:
            if isinstance(err, InferenceServerException):
                message = str(err.message())
                return _chained(self._failure(model, failure_kind(message, err.status()), message), err)
            if isinstance(err, TimeoutError):  # HTTP: no answer within timeout_s
                return _chained(self._failure(model, Failure.FAILED, f"no answer within {self.timeout_s:g} s: {err}"),
                                err)
            # HTTP: refused, reset, unresolvable host; or the connection closed before the answer
            # (geventhttpclient's HTTPConnectionClosed, which is no OSError)
            if isinstance(err, (OSError, HTTPException)):
                return _chained(self._failure(model, Failure.UNREACHABLE, str(err) or type(err).__name__), err)
            return err

        return translate

    def _failure(self, model: str, kind: Failure, message: str) -> Exception:
        """Our error for a failed request to `model` of `kind`, with the server's `message`."""
        if kind is Failure.BUSY:
            return ServerBusyError(f"{model}: the server is busy and turned the request away ({message}); "
                                   "retry later or send fewer requests at once")
        if kind is Failure.NOT_SERVED:
            return ModelNotServedError(f"{model}: the server at {self.url} does not serve it now ({message})")
        if kind is Failure.UNREACHABLE:
            return ServerUnreachableError(f"cannot reach a Triton server at {self.url}: {message}")
        if kind is Failure.FAILED:
            return ServerFailedError(f"{model}: the server at {self.url} failed the request, not for what it holds "
                                     f"({message}); send it again later or to another server")
        # The project's Python models already name themselves ("<model>: ..."): once is enough.
        return InferenceError(message if message.startswith(f"{model}: ") else f"{model}: {message}")

    def _guarded(self, model: str, call: Callable[[], Any]) -> Any:
        """`call()`, its tritonclient or socket errors raised as ours."""
        try:
            return call()
        except Exception as err:
            translated = self._translate(model)(err)
            if translated is err:
                raise
            raise translated from err

    def model_config(self, model: str) -> dict:
        """The configuration Triton serves `model` with (config.pbtxt's fields, snake_case)."""
        if model not in self._configs:
            if self.url.protocol == "grpc":
                config = self._guarded(model, lambda: self._client.get_model_config(
                    model, as_json=True, client_timeout=self.timeout_s))
            else:
                config = self._guarded(model, lambda: self._client.get_model_config(model))
            self._configs[model] = config.get("config", config)  # gRPC wraps it in {"config": ...}
        return self._configs[model]

    def max_batch_size(self, model: str) -> int:
        """The most rows one request to `model` may carry (0: the model takes no batch axis)."""
        return int(self.model_config(model).get("max_batch_size", 0))

    # -- the server's view of its models, and model control ------------------------------------

    def _call(self, method: str, *args: Any) -> Any:
        """Call a tritonclient method that answers JSON over HTTP and protobuf over gRPC; answer
        JSON. Errors are raised as InferenceError or ServerUnreachableError, as for `infer`."""
        kwargs: dict[str, Any] = {}
        if self.url.protocol == "grpc":
            kwargs["client_timeout"] = self.timeout_s
            if method.startswith("get_"):
                kwargs["as_json"] = True
        return self._guarded(args[0] if args else str(self.url),
                             lambda: getattr(self._client, method)(*args, **kwargs))

    def server_metadata(self) -> dict:
        """The server's name, version and extensions."""
        return self._call("get_server_metadata")

    def model_metadata(self, model: str) -> dict:
        """Inputs and outputs with datatype and shape (the batch axis included, as -1)."""
        metadata = self._call("get_model_metadata", model)
        for tensor in (*metadata.get("inputs", ()), *metadata.get("outputs", ())):
            tensor["shape"] = [int(d) for d in tensor.get("shape", ())]  # gRPC's JSON writes int64 as text
        return metadata

    def model_ready(self, model: str) -> bool:
        return bool(self._call("is_model_ready", model))

    def repository_index(self) -> list[dict]:
        """Every model of the repository: name, version, state (READY, UNAVAILABLE, ...), reason."""
        index = self._call("get_model_repository_index")
        return index.get("models", []) if isinstance(index, dict) else index

    def inference_statistics(self) -> dict:
        """Triton's statistics API as JSON (`model_stats`: every loaded model's counters), which
        answers without waiting behind inference work."""
        return self._call("get_inference_statistics")

    def completed_executions(self) -> dict[str, int]:
        """Every loaded model's completed requests so far (successes and failures)."""
        stats = self.inference_statistics()
        counts: dict[str, int] = {}
        for entry in stats.get("model_stats", ()) if isinstance(stats, dict) else ():
            inference = entry.get("inference_stats") or {}
            done = sum(int((inference.get(kind) or {}).get("count", 0)) for kind in ("success", "fail"))
            counts[entry["name"]] = counts.get(entry["name"], 0) + done
        return counts

    def load_model(self, model: str, config: dict | None = None) -> None:
        """Load (or reload) a model; with `config` (Triton's JSON of ModelConfig), with that
        configuration instead of config.pbtxt's. Returns once it is loaded. Needs a server in
        explicit model-control mode."""
        self._configs.pop(model, None)  # a reload may change it
        if config is None:
            self._call("load_model", model)
        else:
            self._guarded(model, lambda: self._client.load_model(
                model, config=json.dumps(config),
                **({"client_timeout": self.timeout_s} if self.url.protocol == "grpc" else {})))

    def unload_model(self, model: str) -> None:
        self._configs.pop(model, None)
        self._call("unload_model", model)

    def close(self) -> None:
        self._client.close()

    def __enter__(self: Client) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def server_words(err: BaseException) -> str:
    """What the server (or the connection) said of a failed request, on one line, without this
    module's framing: "Stub process 'esm2nv_encoder_0_0' is not healthy.", "Stream removed (Socket
    closed)". For a progress line, or a message naming each server's last answer."""
    cause = err.__cause__
    if cause is not None and callable(getattr(cause, "message", None)):  # tritonclient's InferenceServerException
        words = str(cause.message())  # pyright: ignore[reportAttributeAccessIssue] - checked just above
    elif cause is not None:
        words = str(cause) or type(cause).__name__
    else:
        words = str(err) or type(err).__name__
    return " ".join(words.split())


def _quiet_connection_errors() -> None:
    """Keep gevent's hub (this thread's: HTTP requests run as its greenlets) from printing a
    traceback for each request that ends with a connection error: the error reaches the caller
    anyway, raised from `result()` as ours. A server restarted under an HTTP job printed one
    traceback per request in flight."""
    import gevent

    hub = gevent.get_hub()
    if not issubclass(HTTPException, hub.NOT_ERROR):
        hub.NOT_ERROR = (*hub.NOT_ERROR, OSError, HTTPException)


def _chained(new: Exception, cause: Exception) -> Exception:
    new.__cause__ = cause
    return new


class _HttpPending:
    """An HTTP request in flight (tritonclient's InferAsyncRequest) with the Future's `result()`."""

    def __init__(self, request: Any, convert: Callable[[Any], dict[str, np.ndarray]],
                 translate: Callable[[Exception], Exception]) -> None:
        self._request, self._convert, self._translate = request, convert, translate

    def result(self) -> dict[str, np.ndarray]:
        try:
            result = self._request.get_result()
        except Exception as err:
            translated = self._translate(err)
            if translated is err:
                raise
            raise translated from err
        return self._convert(result)
