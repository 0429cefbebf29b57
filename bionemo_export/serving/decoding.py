"""The served decode loops' common parts and N_decodes: hidden states -> sequences by greedy
decoding, the requests the dynamic batcher hands over decoded together.

The decoder graphs (cross_kv, decoder_step) run either in this process with ONNX Runtime
(`LocalDecoder`, the fused layout: one session run per step, no copy of the growing key/value
cache through the Python backend's shared memory) or through Triton BLS calls to the repository's
own models (`BlsDecoder`). Either checks between steps whether every request being decoded was
cancelled (the client's deadline passed, or it hung up), and then stops with a CANCELLED
RequestError instead of decoding for nobody.

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library, numpy and its sibling modules (never onnxruntime: sessions are opened
by the model and handed in).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .kv_decoder import KVCacheDecoder
from .parameters import config_file, model_parameters, number_parameter
from .responses import RequestError, Responder, call_model, cancelled, input_array, triton
from .search import (
    LIMITS,
    TooLargeError,
    check_decode_tokens,
    greedy,
    split_by_tokens,
    validate_hiddens,
)

DECODER_GRAPHS = ("cross_kv", "decoder_step")
DECODER_CONSTANTS = ("begin_id", "end_id", "model_max_decode_length", "max_source_length")
"""Config parameters the build writes from the model: its begin and end token ids, the decoder's
position limit (max_decode_length may be lower, never higher) and the encoder's longest output."""


class CancellableDecoder(KVCacheDecoder):
    """A KVCacheDecoder whose graph calls stop once every request being decoded was cancelled."""

    def __init__(self) -> None:
        self.requests: list = []  # the requests whose rows are being decoded

    def run(self, graph: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]) -> list[np.ndarray]:
        if self.requests and all(request.is_cancelled() for request in self.requests):
            raise cancelled()
        return self.run_graph(graph, inputs, outputs)

    def run_graph(self, graph: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]) -> list[np.ndarray]:
        """Run `graph` ("cross_kv" or "decoder_step") on `inputs`; return `outputs` in order."""
        raise NotImplementedError


class LocalDecoder(CancellableDecoder):
    """The decoder graphs run with ONNX Runtime in this process: `sessions` maps each of
    DECODER_GRAPHS to its session (cross_kv/model.onnx and decoder_step/model.onnx beside model.py)."""

    def __init__(self, sessions: Mapping[str, Any]) -> None:
        super().__init__()
        self.sessions = dict(sessions)

    def run_graph(self, graph: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]) -> list[np.ndarray]:
        return self.sessions[graph].run(list(outputs), inputs)


class BlsDecoder(CancellableDecoder):
    """The decoder graphs run through Triton BLS calls: `models` maps each of DECODER_GRAPHS to
    the repository's model that serves it."""

    def __init__(self, models: Mapping[str, str]) -> None:
        super().__init__()
        self.models = dict(models)

    def run_graph(self, graph: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]) -> list[np.ndarray]:
        return call_model(self.models[graph], inputs, outputs)


def decoder_from_parameters(args: Mapping[str, str], parameters: Mapping[str, str], folder: str
                            ) -> CancellableDecoder:
    """The decoder graphs as config parameters say: `decoder_graphs` "in_process" (their folders
    beside model.py, one ONNX Runtime session each: onnx_session.py is copied there too) or "bls"
    (the models `cross_kv_model` and `decoder_step_model` of the repository)."""
    kind = parameters.get("decoder_graphs", "")
    if kind == "in_process":
        from .onnx_session import create_session
        return LocalDecoder({graph: create_session(args, os.path.join(folder, graph))[0] for graph in DECODER_GRAPHS})
    if kind == "bls":
        return BlsDecoder({graph: parameters[f"{graph}_model"] for graph in DECODER_GRAPHS})
    raise ValueError(f"{config_file(args)}: parameter decoder_graphs is {kind!r}, not 'in_process' or 'bls'; "
                     "rebuild the repository")


def decode_settings(args: Mapping[str, str]) -> dict[str, Any]:
    """The decode loop's settings from config.pbtxt `parameters`: DECODER_CONSTANTS,
    max_decode_length (at most model_max_decode_length), max_hidden_magnitude, and those of
    search.LIMITS present."""
    parameters = model_parameters(args)
    settings = {name: number_parameter(args, parameters, name) for name in
                (*DECODER_CONSTANTS, "max_decode_length", *LIMITS) if name in parameters}
    settings["max_hidden_magnitude"] = number_parameter(args, parameters, "max_hidden_magnitude", kind=float)
    for name in DECODER_CONSTANTS:
        if name not in settings:
            raise ValueError(f"parameter {name} is missing; rebuild the repository")
    limit = settings["model_max_decode_length"]
    if not 1 <= settings["max_decode_length"] <= limit:
        raise ValueError(f"max_decode_length must be between 1 and {limit}, got {settings['max_decode_length']}")
    return settings


def token_ids(settings: Mapping[str, Any]) -> dict[str, int]:
    """The decode functions' token arguments (search.greedy, beam_search, generate)."""
    return dict(begin_id=settings["begin_id"], end_id=settings["end_id"], max_length=settings["max_decode_length"])


def pad_and_join(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """[rows_i, length_i, ...] arrays joined along rows, axis 1 padded with zeros (False) to the longest."""
    length = max(array.shape[1] for array in arrays)
    return np.concatenate([np.pad(array, ((0, 0), (0, length - array.shape[1])) + ((0, 0),) * (array.ndim - 2))
                           for array in arrays])


class GreedyDecodes:
    """N_decodes: each request's hidden states and mask -> its decoded strings.

    Requests are checked alone (a bad one fails alone with INVALID_ARGUMENT); the good ones are
    decoded together in groups within max_decode_tokens; a request whose rows the decoder
    overflows on fails, and its group is decoded again without it."""

    def __init__(self, tokenizer: Any, decoder: CancellableDecoder, settings: Mapping[str, Any],
                 responder: Responder) -> None:
        self.tokenizer, self.decoder, self.settings, self.responder = tokenizer, decoder, settings, responder

    def execute(self, requests: Sequence[Any]) -> tuple[list, int]:
        """(one response per request, bytes of work) for Responder.answer_all."""
        responses: list = [None] * len(requests)
        pending = []  # (request index, hiddens, mask)
        for index, request in enumerate(requests):
            if request.is_cancelled():
                responses[index] = self.responder.error_response(cancelled())
                continue
            try:
                pending.append((index, *self.inputs(request)))
            except Exception as err:  # noqa: BLE001 - this request fails alone
                responses[index] = self.responder.error_response(err)
        nbytes = sum(hiddens.nbytes for _, hiddens, _ in pending)
        budget = self.settings["max_decode_tokens"]
        for group in split_by_tokens([hiddens.shape[:2] for _, hiddens, _ in pending], budget):
            self._decode_group([pending[i] for i in group], requests, responses)
        self.decoder.requests = []
        return responses, 4 * nbytes  # the decode cache holds a few times the hidden states

    def inputs(self, request: Any) -> tuple[np.ndarray, np.ndarray]:
        """The request's hidden states and mask, checked (GenerationError names the problem)."""
        hiddens, mask = input_array(request, "hiddens"), input_array(request, "mask")
        longest = self.settings["max_source_length"]
        if hiddens.ndim == 3 and hiddens.shape[1] > longest:
            raise RequestError(f"hiddens have length {hiddens.shape[1]}; the maximum is {longest} "
                               f"(the encoder's longest output)")
        validate_hiddens(hiddens, mask, self.settings["max_hidden_magnitude"])
        rows, length = hiddens.shape[:2]  # validate_hiddens checked: [batch, length, hidden]
        check_decode_tokens(rows, length, self.settings["max_decode_tokens"], "hiddens [batch, length] "
                            f"{list(hiddens.shape[:2])}")
        return hiddens, mask

    def _decode_group(self, pending: list, requests: Sequence[Any], responses: list) -> None:
        """Decode the requests `pending` (request index, hiddens, mask) as one batch into `responses`."""
        pb_utils = triton()
        while pending:
            self.decoder.requests = [requests[index] for index, _, _ in pending]
            try:
                decoded = self._decode([h for _, h, _ in pending], [m for _, _, m in pending])
            except TooLargeError as err:
                pending = self._drop_overflowing(pending, err.rows, err.reason, responses)
                continue
            except Exception as err:  # noqa: BLE001 - the batch failed: each of its requests says why
                for index, _, _ in pending:
                    responses[index] = self.responder.error_response(err)
                return
            start = 0
            for index, hiddens, _ in pending:
                rows = decoded[start:start + len(hiddens)]
                start += len(hiddens)
                strings = np.array([[s.encode("utf-8")] for s in rows], dtype=np.object_)
                responses[index] = pb_utils.InferenceResponse([pb_utils.Tensor("sequences", strings)])
            return

    def _drop_overflowing(self, pending: list, rows: list[int], reason: str, responses: list) -> list:
        """Answer the requests owning the joined batch rows `rows` with an overflow error (naming
        their own rows); return the others."""
        kept, start = [], 0
        for index, hiddens, mask in pending:
            own = [row - start for row in rows if start <= row < start + len(hiddens)]
            start += len(hiddens)
            if own:
                responses[index] = self.responder.error_response(TooLargeError(own, "hiddens", reason))
            else:
                kept.append((index, hiddens, mask))
        return kept

    def _decode(self, hiddens_list: list[np.ndarray], mask_list: list[np.ndarray]) -> list[str]:
        """Pad every request's hidden states to the longest, decode all rows, detokenize."""
        hiddens, mask = pad_and_join(hiddens_list), pad_and_join(mask_list)
        ids = greedy(self.decoder, hiddens.astype(np.float32), mask.astype(bool), **token_ids(self.settings))
        return [self.tokenizer.decode(row) for row in ids]
