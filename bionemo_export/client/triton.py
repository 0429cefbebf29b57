"""A small tritonclient wrapper: one URL string picks HTTP or gRPC, and results come back as numpy.

URLs follow BioNeMo's clients: `http://host:8000` (the default), `grpc://host:8001`, or a bare
`host:port` (HTTP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_URL = "http://localhost:8000"

_NUMPY_TO_TRITON = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32",
                    np.dtype(np.bool_): "BOOL", np.dtype(np.object_): "BYTES", np.dtype(np.float16): "FP16"}


class InferenceError(RuntimeError):
    """The server refused or failed a request; the message is the server's."""


class ServerUnreachableError(ConnectionError):
    """No Triton server answers at the URL (refused, unresolvable, timed out); the message names the URL."""


@dataclass(frozen=True)
class TritonUrl:
    protocol: str  # "http" or "grpc"
    address: str  # host:port

    @classmethod
    def parse(cls, url: str) -> "TritonUrl":
        for protocol in ("http", "grpc"):
            prefix = f"{protocol}://"
            if url.startswith(prefix):
                return cls(protocol, url[len(prefix):].rstrip("/"))
        if "://" in url:
            raise ValueError(f"unsupported URL scheme in {url!r}: use http://host:port or grpc://host:port")
        return cls("http", url)

    def __str__(self) -> str:
        return f"{self.protocol}://{self.address}"


def strings_to_tensor(sequences: list[str] | tuple[str, ...]) -> np.ndarray:
    """Sequences as Triton expects them: UTF-8 bytes in an object array of shape [batch, 1]."""
    return np.array([[s.encode("utf-8")] for s in sequences], dtype=np.object_).reshape(len(sequences), 1)


class TritonClient:
    """Run inference on one server over HTTP or gRPC."""

    def __init__(self, url: str = DEFAULT_URL, *, timeout_s: float = 300.0) -> None:
        self.url = TritonUrl.parse(url)
        self.timeout_s = timeout_s
        if self.url.protocol == "grpc":
            import tritonclient.grpc as module
        else:
            import tritonclient.http as module
        self._module: Any = module
        kwargs = {} if self.url.protocol == "grpc" else {"network_timeout": timeout_s, "connection_timeout": timeout_s}
        self._client = module.InferenceServerClient(self.url.address, **kwargs)

    def infer(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        """Send `inputs` (name -> array with the batch axis first) to `model`; return the outputs."""
        from tritonclient.utils import InferenceServerException

        infer_inputs = []
        for name, array in inputs.items():
            dtype = _NUMPY_TO_TRITON.get(array.dtype)
            if dtype is None:
                raise TypeError(f"input {name!r}: unsupported numpy dtype {array.dtype}")
            tensor = self._module.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            infer_inputs.append(tensor)
        requested = [self._module.InferRequestedOutput(name) for name in outputs] if outputs else None
        try:
            if self.url.protocol == "grpc":
                result = self._client.infer(model, infer_inputs, outputs=requested, client_timeout=self.timeout_s)
            else:
                result = self._client.infer(model, infer_inputs, outputs=requested)
        except InferenceServerException as err:
            if err.status() == "StatusCode.UNAVAILABLE":  # gRPC: nothing listening, or the connection dropped
                raise ServerUnreachableError(f"cannot reach a Triton server at {self.url}: {err.message()}") from err
            raise InferenceError(f"{model}: {err.message()}") from err
        except OSError as err:  # HTTP: refused, reset, unresolvable host, timed out
            raise ServerUnreachableError(f"cannot reach a Triton server at {self.url}: {err}") from err
        if outputs is None:
            response = result.get_response(as_json=True) if self.url.protocol == "grpc" else result.get_response()
            outputs = [output["name"] for output in response["outputs"]]
        return {name: result.as_numpy(name) for name in outputs}

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "TritonClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
