"""A graph applied to each position on its own (the masked-LM head: hiddens -> log_probs), run by
the Python backend: every row of every request the dynamic batcher hands over is flattened into
one sequence of positions and run in calls of at most `token_budget` positions.

Exact because nothing in such a graph mixes positions (dense, layer norm, softmax over the last
axis): a position's output does not depend on the positions it runs with, so requests of any
lengths are joined without padding (the model's input allows ragged batches). A request's padding
positions are computed too (their rows are garbage the mask marks False, as in `hiddens`).

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library, numpy and its sibling modules (the ONNX Runtime session is handed in).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .responses import RequestError, Responder, input_array, triton


class PositionwiseGraph:
    """`session` maps input `input_name` [1, positions, width] to output `output_name`
    [1, positions, D]; requests send [rows, length, width]."""

    def __init__(self, session: Any, *, input_name: str, output_name: str, width: int, token_budget: int,
                 responder: Responder) -> None:
        self.session, self.input_name, self.output_name = session, input_name, output_name
        self.width, self.token_budget, self.responder = width, max(int(token_budget), 1), responder

    def read(self, request: Any) -> np.ndarray:
        value = input_array(request, self.input_name)
        if value is None or value.ndim != 3 or value.shape[2] != self.width:
            shape = None if value is None else list(value.shape)
            raise RequestError(f"input '{self.input_name}' must have shape [batch, length, {self.width}], got {shape}")
        if not np.isfinite(value).all():
            raise RequestError(f"input '{self.input_name}' holds NaN or Inf")
        return value.astype(np.float32, copy=False)

    def execute(self, requests: Sequence[Any]) -> tuple[list, int]:
        """(one response per request, bytes of work) for Responder.answer_all."""
        responses: list = [None] * len(requests)
        accepted: list[tuple[int, np.ndarray]] = []
        for index, request in enumerate(requests):
            try:
                accepted.append((index, self.read(request)))
            except Exception as err:  # noqa: BLE001 - this request fails alone
                responses[index] = self.responder.error_response(err)
        if not accepted:
            return responses, 0
        flat = np.concatenate([value.reshape(-1, self.width) for _, value in accepted])
        try:
            out = self.run(flat)
        except Exception as err:  # noqa: BLE001 - the graph failed: every request of this call says why
            for index, _ in accepted:
                responses[index] = self.responder.error_response(err)
            return responses, 0
        pb_utils = triton()
        start = 0
        for index, value in accepted:
            rows, length, _ = value.shape
            piece = out[start:start + rows * length].reshape(rows, length, -1)
            start += rows * length
            responses[index] = pb_utils.InferenceResponse([pb_utils.Tensor(self.output_name, piece)])
        return responses, flat.nbytes + out.nbytes

    def run(self, flat: np.ndarray) -> np.ndarray:
        """The graph over `flat` [positions, width], in calls of at most token_budget positions."""
        pieces = [self.session.run([self.output_name],
                                   {self.input_name: flat[start:start + self.token_budget][None]})[0][0]
                  for start in range(0, len(flat), self.token_budget)]
        return np.concatenate(pieces) if pieces else np.zeros((0, 0), dtype=np.float32)
