"""A Python-backend model that runs one exported graph whose batch is not its first axis (the
decoder graphs with `--backend python` in the ensemble layout): each request one ONNX Runtime
call, only the outputs it asks for computed.

An internal model, but a client can call it: inputs that disagree on a named axis, axes over
their limits and token ids outside the vocabulary fail with INVALID_ARGUMENT naming the input
(ONNX Runtime would fail with its own message, or read out of range).

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library, numpy and its sibling modules (the session is handed in).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .parameters import json_parameter
from .responses import RequestError, Responder, input_array, triton, wanted_outputs

GRAPH_INPUT_PARAMETERS = ("axes", "axis_limits", "token_inputs")


class GraphInputs:
    """What a graph's inputs must satisfy: `axes` each input's axes (a name is a dynamic axis,
    which every input naming it must agree on); `axis_limits` the largest size of a dynamic axis
    (the graph's position limit); `token_inputs` inputs holding token ids -> the vocabulary size
    (ids must lie in [0, size))."""

    def __init__(self, axes: Mapping[str, Sequence[Any]], axis_limits: Mapping[str, int],
                 token_inputs: Mapping[str, int]) -> None:
        self.axes, self.axis_limits, self.token_inputs = dict(axes), dict(axis_limits), dict(token_inputs)

    @classmethod
    def from_parameters(cls, args: Mapping[str, str], parameters: Mapping[str, str]) -> GraphInputs:
        """The checks the config's JSON parameters `axes`, `axis_limits` and `token_inputs` describe
        (model_repository's `graph_input_parameters` writes them)."""
        return cls(*(json_parameter(args, parameters, name) for name in GRAPH_INPUT_PARAMETERS))

    def check(self, feed: Mapping[str, np.ndarray]) -> None:
        """RequestError unless the inputs agree on every named axis, stay within the axis limits
        and hold token ids inside the vocabulary."""
        sizes: dict[str, tuple[str, int]] = {}  # axis -> (the first input naming it, its size there)
        for name, value in feed.items():
            for axis, size in zip(self.axes[name], value.shape):
                if not isinstance(axis, str):
                    continue
                first, expected = sizes.setdefault(axis, (name, size))
                if size != expected:
                    raise RequestError(f"inputs '{first}' and '{name}' disagree on axis '{axis}': "
                                       f"{expected} vs {size}")
                if axis in self.axis_limits and size > self.axis_limits[axis]:
                    raise RequestError(f"input '{name}': axis '{axis}' is {size}; the maximum is "
                                       f"{self.axis_limits[axis]}")
        for name, size in self.token_inputs.items():
            ids = feed[name]
            bad = np.argwhere((ids < 0) | (ids >= size))
            if bad.size:
                where = tuple(bad[0])
                axes = list(self.axes[name])
                row = where[axes.index("batch")] if "batch" in axes else where[0]
                raise RequestError(f"input '{name}' row {row}: token id {ids[where]} is outside the vocabulary "
                                   f"[0, {size})")


class GraphModel:
    """Each request: its inputs (`inputs` names) checked by `checks`, one `session` run of the
    outputs it asked for (of `outputs`, in graph order)."""

    def __init__(self, session: Any, inputs: Sequence[str], outputs: Sequence[str], checks: GraphInputs,
                 responder: Responder) -> None:
        self.session, self.inputs, self.outputs = session, tuple(inputs), tuple(outputs)
        self.checks, self.responder = checks, responder

    def execute(self, requests: Sequence[Any]) -> tuple[list, int]:
        """(one response per request, bytes of work) for Responder.answer_all."""
        pb_utils = triton()
        responses, work = [], 0
        for request in requests:
            try:
                feed = {name: input_array(request, name) for name in self.inputs}
                self.checks.check(feed)
                wanted = wanted_outputs(request, self.outputs)
                results = self.session.run(list(wanted), feed)
            except Exception as err:  # noqa: BLE001 - this request fails alone
                responses.append(self.responder.error_response(err))
                continue
            work = max(work, sum(value.nbytes for value in results))
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor(name, value) for name, value in zip(wanted, results)]))
        return responses, work
