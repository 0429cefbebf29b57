"""N_member_mean run by the Python backend: the last step of a checkpoint ensemble's N_logits, the
mean of its members' log-probabilities.

Inputs `log_probs_1` ... `log_probs_K` FP32 [batch, length, A], one per member (each member's
encoder and masked-LM head, run by N_logits' steps side by side on the same tokens); outputs
`log_probs` FP32 [batch, length, A], their mean position by position, and `member_log_probs` FP32
[batch, K, length, A], each member's as it came (a request that names its outputs gets this one
only when it names it).

Why the mean of the log-probabilities: every score N_scores computes (ESM's wt-marginal and
masked-marginal, the pseudo-log-likelihood) is a sum or difference of log-probabilities at
positions, so the score of the mean equals the mean of the members' scores: ESM's convention for
ESM-1v, whose variant-prediction script scores each seed and averages the scores. The mean of
log-probabilities is the log of the geometric mean of the members' probabilities: not normalized
(its exponentials sum to at most 1 over the alphabet), which scores, being differences and sums of
log-probabilities, do not need.

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library, numpy and its sibling modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .responses import RequestError, Responder, input_array, triton, wanted_outputs

OUTPUTS = ("log_probs", "member_log_probs")


def member_inputs(members: int) -> tuple[str, ...]:
    """The model's input names: log_probs_1 ... log_probs_K."""
    return tuple(f"log_probs_{number}" for number in range(1, members + 1))


def mean_log_probs(member_log_probs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(mean [batch, length, A], stacked [batch, K, length, A]) of the members' log-probabilities,
    each [batch, length, A] of one shape. The mean is summed in float64 and rounded once to FP32.
    ValueError when the shapes differ (the members ran on different tokens) or no member is given."""
    if not member_log_probs:
        raise ValueError("no member log-probabilities to average")
    arrays = [np.asarray(value, dtype=np.float32) for value in member_log_probs]
    shapes = {value.shape for value in arrays}
    if len(shapes) != 1:
        raise ValueError(f"the members' log-probabilities have different shapes {sorted(shapes)}: they must come "
                         "from the same tokens")
    stacked = np.stack(arrays, axis=1)
    return stacked.mean(axis=1, dtype=np.float64).astype(np.float32), stacked


class MemberMean:
    """The N_member_mean model over `members` inputs."""

    def __init__(self, members: int, responder: Responder) -> None:
        if members < 2:
            raise ValueError(f"an ensemble has at least two members, got {members}")
        self.inputs, self.responder = member_inputs(members), responder

    def read(self, request: Any) -> list[np.ndarray]:
        values = []
        for name in self.inputs:
            value = input_array(request, name)
            if value is None or value.ndim != 3:
                shape = None if value is None else list(value.shape)
                raise RequestError(f"input '{name}' must have shape [batch, length, alphabet], got {shape}")
            values.append(value)
        return values

    def execute(self, requests: Sequence[Any]) -> tuple[list, int]:
        """(one response per request, bytes of work) for Responder.answer_all."""
        pb_utils = triton()
        responses, work = [], 0
        for request in requests:
            try:
                mean, stacked = mean_log_probs(self.read(request))
            except Exception as err:  # noqa: BLE001 - this request fails alone
                responses.append(self.responder.error_response(err))
                continue
            work += stacked.nbytes
            outputs = {"log_probs": mean, "member_log_probs": stacked}
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor(name, outputs[name]) for name in wanted_outputs(request, OUTPUTS)]))
        return responses, work
