"""A small stand-in for the Python backend's `triton_python_backend_utils`, enough for the served
modules (bionemo_export/serving/) to run without a server: tensors, requests and responses, errors
with Triton's codes, the logger, and BLS calls answered by Python functions.

`install(monkeypatch)` puts it where `import triton_python_backend_utils` finds it.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


class TritonError:
    """pb_utils.TritonError: a message and one of Triton's codes (the values of r24.10)."""

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, {self._code})"


class Tensor:
    def __init__(self, name: str, value: np.ndarray) -> None:
        self._name, self._value = name, np.asarray(value)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._value


BLS_MODELS: dict[str, Callable[[dict[str, np.ndarray], list[str]], InferenceResponse]] = {}
"""Model name -> what a BLS call to it answers: fn(inputs, requested outputs) -> InferenceResponse."""


class InferenceRequest:
    """A request handed to execute() (inputs; outputs asked for; cancelled or not), or one a model
    sends through BLS with exec()."""

    def __init__(self, model_name: str = "", requested_output_names: list[str] | None = None,
                 inputs: list[Tensor] | None = None, cancelled: bool = False) -> None:
        self.model_name = model_name
        self._requested = list(requested_output_names or [])
        self.inputs = list(inputs or [])
        self.cancelled = cancelled

    def requested_output_names(self) -> list[str]:
        return self._requested

    def is_cancelled(self) -> bool:
        return self.cancelled

    def exec(self) -> InferenceResponse:
        if self.model_name not in BLS_MODELS:
            return InferenceResponse(error=TritonError(f"Request for unknown model: '{self.model_name}' is not found",
                                                       TritonError.INTERNAL))
        return BLS_MODELS[self.model_name]({t.name(): t.as_numpy() for t in self.inputs}, self._requested)


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None) -> None:
        self._outputs, self._error = list(output_tensors or []), error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def output(self, name: str) -> np.ndarray:
        """This fake's shortcut: output `name` as an array."""
        tensor = get_output_tensor_by_name(self, name)
        assert tensor is not None, f"the response has no output {name!r}"
        return tensor.as_numpy()


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((tensor for tensor in request.inputs if tensor.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((tensor for tensor in response.output_tensors() if tensor.name() == name), None)


class Logger:
    """pb_utils.Logger; what was logged is kept in `lines` for tests to read."""

    lines: list[str] = []

    @classmethod
    def log_error(cls, message: str) -> None:
        cls.lines.append(message)

    log_info = log_warn = log_verbose = log_error


def request(inputs: dict[str, Any], *, requested: list[str] | None = None, cancelled: bool = False) -> InferenceRequest:
    """A request as execute() receives it: {input name: array}."""
    return InferenceRequest(requested_output_names=requested, cancelled=cancelled,
                            inputs=[Tensor(name, value) for name, value in inputs.items()])


def install(monkeypatch) -> types.ModuleType:
    """Make `import triton_python_backend_utils` give this module (for the test's duration), with
    no BLS models and an empty log."""
    module = sys.modules[__name__]
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", module)
    monkeypatch.setattr(Logger, "lines", [])
    monkeypatch.setattr(module, "BLS_MODELS", {})
    return module


def standalone_import(model_py: str | Path) -> str:
    """Python source that a fresh interpreter (`python -I -c`, in the model's version folder) runs
    first: it makes this module `triton_python_backend_utils` (bound as `pb`) and imports the
    generated `model_py` as `module`, as the Python backend's stub does."""
    return (f"import importlib.util, sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "import fake_pb_utils as pb\nsys.modules['triton_python_backend_utils'] = pb\n"
            f"spec = importlib.util.spec_from_file_location('model', {str(model_py)!r})\n"
            "module = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(module)\n")
