"""A fine-tuned head's logits turned into label names (N_labels, the last step of N_predictions).

    single_label_classification  the argmax's name                                   b"LABEL_7"
    multi_label_classification   the names whose sigmoid > 0.5 (logit > 0), joined by "," (b"" for none)
    regression                   the values as text, joined by ","                     b"0.4213"

Requests send `logits` [rows, C] (sequence heads) or [rows, length, C] (token heads: every row
gets a label, padding included; the ensemble's `mask` says which are real). The names and the
problem type come from config.pbtxt `parameters` (`labels`, a JSON list; `problem_type`), never
from this code.

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library, numpy and its sibling modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .responses import RequestError, Responder, input_array, triton

PROBLEM_TYPES = ("single_label_classification", "multi_label_classification", "regression")


def label_names(logits: np.ndarray, labels: Sequence[str], problem_type: str) -> np.ndarray:
    """An object array of UTF-8 bytes shaped like logits without its last axis (of len(labels))."""
    if problem_type not in PROBLEM_TYPES:
        raise ValueError(f"problem_type {problem_type!r} is not one of {', '.join(PROBLEM_TYPES)}")
    logits = np.asarray(logits, dtype=np.float32)
    flat = logits.reshape(-1, logits.shape[-1])
    if problem_type == "single_label_classification":
        names = [labels[int(i)] for i in np.argmax(flat, axis=-1)]
    elif problem_type == "multi_label_classification":  # sigmoid(x) > 0.5 exactly when x > 0
        names = [",".join(labels[int(i)] for i in np.flatnonzero(row > 0)) for row in flat]
    else:
        names = [",".join(format(float(value), ".6g") for value in row) for row in flat]
    out = np.empty(len(names), dtype=np.object_)
    out[:] = [name.encode("utf-8") for name in names]
    return out.reshape(logits.shape[:-1])


class LabelModel:
    """Each request's `logits` [rows, C] -> `label` [rows, 1]; [rows, length, C] -> [rows, length]."""

    def __init__(self, labels: Sequence[str], problem_type: str, responder: Responder) -> None:
        if problem_type not in PROBLEM_TYPES:
            raise ValueError(f"problem_type {problem_type!r} is not one of {', '.join(PROBLEM_TYPES)}")
        if not labels:
            raise ValueError("labels is empty")
        self.labels, self.problem_type, self.responder = tuple(labels), problem_type, responder

    def read(self, request: Any) -> np.ndarray:
        value = input_array(request, "logits")
        if value is None or value.ndim not in (2, 3) or value.shape[-1] != len(self.labels):
            shape = None if value is None else list(value.shape)
            raise RequestError(f"input 'logits' must have shape [batch, {len(self.labels)}] or "
                               f"[batch, length, {len(self.labels)}], got {shape}")
        return value

    def execute(self, requests: Sequence[Any]) -> tuple[list, int]:
        """(one response per request, bytes of work) for Responder.answer_all."""
        pb_utils = triton()
        responses, work = [], 0
        for request in requests:
            try:
                logits = self.read(request)
                names = label_names(logits, self.labels, self.problem_type)
            except Exception as err:  # noqa: BLE001 - this request fails alone
                responses.append(self.responder.error_response(err))
                continue
            if logits.ndim == 2:
                names = names.reshape(-1, 1)
            work += logits.nbytes
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("label", names)]))
        return responses, work
