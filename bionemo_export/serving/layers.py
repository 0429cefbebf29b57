"""N_layers run by the Python backend: per-residue states and pooled embeddings of the layers each
request asks for, from the repository's layers graph (N_layer_graph: the encoder answering every
layer's states as separate outputs `hiddens_0` .. `hiddens_N`).

Each request row is one sequence (`sequences` [batch, 1]); optional `layers` INT32 [batch, K] (the
same K layers on every row; default: the last) and `include` BYTES [batch, K'] (the same on every
row; default: mean) choose what it answers:

- layers in ESM's numbering: 0 the embedding layer's output, 1..N the blocks (N after the final
  layer norm, what N_hiddens answers), negative from the end (-1 is N); several at once, answered
  in the order asked. A value outside -(N+1)..N fails its request with INVALID_ARGUMENT naming it
  and the range.
- include: `mean` (over the residues: N_embeddings' pooling) -> `embeddings` [batch, K, H];
  `bos` (the BOS/CLS token's state) -> `embeddings_bos`; `max` (element-wise over the residues)
  -> `embeddings_max`; `per_tok` -> `hiddens` [batch, K, T, H] and `mask` [batch, T], laid out as
  N_hiddens answers them (T the request's longest tokenized sequence, 0 past each one's end). A
  model whose rows start with a residue (ProtT5, MegaMolBART) has no BOS state: `bos` fails its
  request naming why.

The rows of every request the dynamic batcher hands over are tokenized here (a bad sequence fails
its request alone), grouped by the layers they need and sorted by length, and sent to
N_layer_graph through BLS in calls of at most `max_rows` rows and `token_budget` tokens (rows x
padded length; a row alone may exceed it), each call asking only for its rows' layers: the other
layers' states never leave the graph model.

This file is copied verbatim into generated Triton Python-backend model folders, so it imports
only the standard library, numpy and its sibling modules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

if __package__:  # imported from the bionemo_export package
    from bionemo_export.serving.responses import RequestError, Responder, call_model, input_array, triton
else:  # copied beside a generated model.py, where its siblings are top-level modules
    from responses import RequestError, Responder, call_model, input_array, triton

POOLINGS = ("mean", "bos", "max")
"""The poolings, in the order they are answered."""
PER_RESIDUE = "per_tok"
"""ESM extract.py's name for every residue's state."""
INCLUDE_CHOICES = (*POOLINGS, PER_RESIDUE)
DEFAULT_INCLUDE = ("mean",)
POOLED_OUTPUTS = {"mean": "embeddings", "bos": "embeddings_bos", "max": "embeddings_max"}
"""Each pooling's output of N_layers."""
NO_BOS = "rows start with a residue (no BOS/CLS token before it, as in ProtT5); choose mean or max"
"""Why a model without a BOS token answers no `bos` pooling (here and in the bulk-job client)."""
DEFAULT_TOKEN_BUDGET = 8192

RunGraph = Callable[[np.ndarray, np.ndarray, Sequence[int]], Sequence[np.ndarray]]
"""(input_ids, attention_mask INT64 [rows, T], layers) -> each layer's states FP32 [rows, T, H], as
N_layer_graph answers its outputs hiddens_<layer>."""


def layer_output_name(layer: int) -> str:
    """N_layer_graph's output holding layer `layer` (models/layer_states.py names them the same)."""
    return f"hiddens_{layer}"


def graph_caller(model_name: str) -> RunGraph:
    """The BLS call to the repository's N_layer_graph model, asking for `layers` only."""
    def run(input_ids: np.ndarray, attention_mask: np.ndarray, layers: Sequence[int]) -> list[np.ndarray]:
        return call_model(model_name, {"input_ids": input_ids, "attention_mask": attention_mask},
                          [layer_output_name(layer) for layer in layers])
    return run


# ---------------------------------------------------------------------------- choices and pooling
def layer_range(num_layers: int) -> str:
    """The layers a model of `num_layers` blocks answers, as messages say it."""
    return (f"0..{num_layers} (0 the embedding layer's output, {num_layers} the last block's after the final "
            f"layer norm), or -{num_layers + 1}..-1 counted from the end")


def normalize_layers(values: Sequence[int], num_layers: int, name: str = "input 'layers'") -> tuple[int, ...]:
    """The layers asked for as 0..num_layers (negative counted from the end, -1 the last), in the
    order asked; RequestError naming a value outside the range, and the range."""
    if not len(values):
        raise RequestError(f"{name} is empty; name at least one layer: {layer_range(num_layers)}")
    layers = []
    for value in values:
        value = int(value)
        if not -(num_layers + 1) <= value <= num_layers:
            raise RequestError(f"{name} value {value} is out of range: this model's layers are "
                               f"{layer_range(num_layers)}")
        layers.append(value if value >= 0 else num_layers + 1 + value)
    return tuple(layers)


def parse_include(values: Sequence[str], has_bos: bool, name: str = "input 'include'") -> tuple[str, ...]:
    """The choices asked for, in INCLUDE_CHOICES' order; RequestError naming an unknown value (and
    the choices), or `bos` for a model without a BOS token (and why)."""
    chosen = [str(value).strip() for value in values]
    if not [c for c in chosen if c]:
        raise RequestError(f"{name} is empty; choose among {', '.join(INCLUDE_CHOICES)}")
    for value in chosen:
        if value and value not in INCLUDE_CHOICES:
            raise RequestError(f"{name} value {value!r} is unknown; choose among {', '.join(INCLUDE_CHOICES)}")
    if "bos" in chosen and not has_bos:
        raise RequestError(f"{name} asks for bos, but this model's {NO_BOS}")
    return tuple(choice for choice in INCLUDE_CHOICES if choice in chosen)


def starts_with_residue(mask: np.ndarray) -> bool:
    """Whether a tokenized row ([T] residue mask) has no BOS token: its first position is a residue."""
    return not len(mask) or bool(mask[0])


def has_bos_token(tokenizer: Any, sample: str | bytes) -> bool:
    """Whether `tokenizer`'s rows start with a BOS/CLS token: `sample` tokenized, its first token is
    not a residue."""
    encoded = tokenizer.encode([sample])
    tokens = np.asarray(encoded.attention_mask[0]).astype(bool)
    return not starts_with_residue(np.asarray(encoded.residue_mask[0]).astype(bool)[tokens])


def pool(states: np.ndarray, mask: np.ndarray, pooling: str) -> np.ndarray:
    """One pooling of states [..., T, H] over mask [..., T] (True on the residues) -> [..., H]:
    `mean` over the residues (accumulated in float64), `max` element-wise over them, `bos` the
    first position's state (the caller checks the row has a BOS token: starts_with_residue)."""
    states = np.asarray(states)
    mask = np.asarray(mask, dtype=bool)
    if pooling == "mean":
        weights = mask[..., None]
        counts = np.maximum(mask.sum(axis=-1, keepdims=True), 1)
        return ((states * weights).sum(axis=-2, dtype=np.float64) / counts).astype(states.dtype)
    if pooling == "max":
        empty = ~mask.any(axis=-1, keepdims=True)
        found = np.where(mask[..., None], states, -np.inf).max(axis=-2)
        return np.where(empty, 0, found).astype(states.dtype)
    if pooling == "bos":
        return states[..., 0, :]
    raise ValueError(f"unknown pooling {pooling!r}; poolings are {', '.join(POOLINGS)}")


def _one_value_per_request(name: str, column: np.ndarray, batch: int) -> np.ndarray:
    """Row 0 of a [batch, K] option, checked to be the same on every row."""
    if column.ndim != 2 or column.shape[0] != batch or not column.shape[1]:
        raise RequestError(f"input '{name}' must have shape [batch, K] = [{batch}, K >= 1] (the same on every row "
                           f"of 'sequences'), got {list(column.shape)}")
    for row in range(1, batch):
        if not np.array_equal(column[row], column[0]):
            raise RequestError(f"input '{name}' row {row} differs from row 0 ({column[row].tolist()} vs "
                               f"{column[0].tolist()}): one choice for the whole request")
    return column[0]


def _text(name: str, value: Any) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"input '{name}' holds bytes that are not UTF-8: {value[:20]!r}") from None
    return str(value)


# ---------------------------------------------------------------------------- the model
@dataclass
class _Row:
    request: int
    row: int
    ids: np.ndarray
    """The sequence's tokens, unpadded."""
    residues: np.ndarray
    """True on its residues, [len(ids)]."""
    layers: tuple[int, ...]
    """The distinct layers its request asks for, sorted."""


@dataclass
class _Asked:
    layers: tuple[int, ...]
    """In the order asked (normalized)."""
    include: tuple[str, ...]
    rows: int


class LayerEmbeddings:
    """The N_layers model: `tokenizer` the repository's (tokenizer.json), `run_graph` N_layer_graph
    (each call answering the layers asked), `num_layers` the encoder's blocks N, `has_bos` whether
    its rows start with a BOS/CLS token, `token_budget` and `max_rows` what one graph call holds."""

    def __init__(self, tokenizer: Any, run_graph: RunGraph, *, num_layers: int, has_bos: bool, token_budget: int,
                 max_rows: int, responder: Responder) -> None:
        self.tokenizer, self.run_graph, self.responder = tokenizer, run_graph, responder
        self.num_layers, self.has_bos = int(num_layers), bool(has_bos)
        self.token_budget, self.max_rows = max(int(token_budget), 1), max(int(max_rows), 1)
        if self.num_layers < 1:
            raise ValueError(f"parameter num_layers is {self.num_layers}; a model has at least one block")

    def execute(self, requests: Sequence[Any]) -> tuple[list, int]:
        """(one response per request, bytes of work) for Responder.answer_all."""
        pb_utils = triton()
        answers, failures = self.answer([{name: input_array(request, name)
                                          for name in ("sequences", "layers", "include")} for request in requests])
        responses, work = [], 0
        for index in range(len(requests)):
            if index in failures:
                responses.append(self.responder.error_response(failures[index]))
                continue
            outputs = answers[index]
            work += sum(value.nbytes for value in outputs.values())
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(name, value)
                                                         for name, value in outputs.items()]))
        return responses, work

    def answer(self, requests: Sequence[dict[str, np.ndarray | None]]
               ) -> tuple[dict[int, dict[str, np.ndarray]], dict[int, BaseException]]:
        """({request: its outputs by name}, {request: its error}) for the requests' input arrays
        (`sequences`, and `layers`, `include` or None): a request's bad input, or a failed graph call
        (the requests of its rows), fails alone."""
        failures: dict[int, BaseException] = {}
        asked: dict[int, _Asked] = {}
        rows: list[_Row] = []
        for index, inputs in enumerate(requests):
            try:
                found, asked[index] = self.read(index, inputs)
            except Exception as err:  # noqa: BLE001 - this request fails alone
                failures[index] = err
                continue
            rows += found
        states: dict[tuple[int, int], dict[int, np.ndarray]] = {}
        for call in self.calls(rows):
            try:
                answered = self.run(call)
            except Exception as err:  # noqa: BLE001 - the requests of this call fail, the others go on
                failures.update({row.request: err for row in call})
                continue
            states.update({(row.request, row.row): row_states for row, row_states in zip(call, answered)})
        answers = {}
        for index, request in asked.items():
            if index not in failures:
                found = [row for row in rows if row.request == index]
                answers[index] = self.assemble(request, found, [states[(index, row.row)] for row in found])
        return answers, failures

    def read(self, index: int, inputs: dict[str, np.ndarray | None]) -> tuple[list[_Row], _Asked]:
        """The request's rows tokenized and its choices; RequestError (or the tokenizer's error)
        naming the input and the value."""
        column = inputs.get("sequences")
        if column is None or column.ndim != 2 or column.shape[1] != 1 or not column.shape[0]:
            shape = None if column is None else list(column.shape)
            raise RequestError(f"input 'sequences' must have shape [batch, 1] with batch >= 1, got {shape}")
        batch = column.shape[0]
        layers_column = inputs.get("layers")
        if layers_column is None:
            layers = (self.num_layers,)
        else:
            values = _one_value_per_request("layers", np.asarray(layers_column), batch)
            if values.dtype.kind not in "iu":
                raise RequestError(f"input 'layers' must hold integers (INT32), got {values.dtype}")
            layers = normalize_layers(values.tolist(), self.num_layers)
        include_column = inputs.get("include")
        if include_column is None:
            include = DEFAULT_INCLUDE
        else:
            values = _one_value_per_request("include", np.asarray(include_column), batch)
            include = parse_include([_text("include", value) for value in values.tolist()], self.has_bos)
        sequences = [value if isinstance(value, bytes) else str(value).encode("utf-8") for value in column[:, 0]]
        encoded = self.tokenizer.encode(sequences)
        distinct = tuple(sorted(set(layers)))
        found = []
        for row in range(batch):
            tokens = np.asarray(encoded.attention_mask[row]).astype(bool)
            found.append(_Row(index, row, np.asarray(encoded.input_ids[row])[tokens],
                              np.asarray(encoded.residue_mask[row]).astype(bool)[tokens], distinct))
        return found, _Asked(layers, include, batch)

    def calls(self, rows: list[_Row]) -> list[list[_Row]]:
        """The rows grouped by the layers they need, sorted by length, cut into graph calls of at
        most max_rows rows and token_budget tokens (a row alone may exceed the budget)."""
        calls: list[list[_Row]] = []
        for row in sorted(rows, key=lambda r: (r.layers, len(r.ids))):
            if calls:
                current = calls[-1]
                longest = max(len(row.ids), len(current[-1].ids))
                if current[-1].layers == row.layers and len(current) < self.max_rows \
                        and (len(current) + 1) * longest <= self.token_budget:
                    current.append(row)
                    continue
            calls.append([row])
        return calls

    def run(self, call: list[_Row]) -> list[dict[int, np.ndarray]]:
        """Each row's {layer: states [len(ids), H]} from one graph call over the rows, padded to the
        longest, asking for their layers only."""
        length = max(len(row.ids) for row in call)
        layers = call[0].layers
        input_ids = np.full((len(call), length), self.tokenizer.pad_id, dtype=np.int64)
        attention_mask = np.zeros((len(call), length), dtype=np.int64)
        for i, row in enumerate(call):
            input_ids[i, :len(row.ids)] = row.ids
            attention_mask[i, :len(row.ids)] = 1
        answered = [np.asarray(states, dtype=np.float32) for states in self.run_graph(input_ids, attention_mask,
                                                                                       layers)]
        if len(answered) != len(layers) or any(a.ndim != 3 or a.shape[:2] != (len(call), length) for a in answered):
            raise RuntimeError(f"the layers graph answered {[list(a.shape) for a in answered]} for layers "
                               f"{list(layers)} of {len(call)} rows of {length} tokens")
        return [{layer: states[i, :len(row.ids)] for layer, states in zip(layers, answered)}
                for i, row in enumerate(call)]

    def assemble(self, asked: _Asked, rows: list[_Row], states: list[dict[int, np.ndarray]]) -> dict[str, np.ndarray]:
        """One request's outputs: its rows' states of the layers asked, in the order asked."""
        length = max(len(row.ids) for row in rows)
        hidden = next(iter(states[0].values())).shape[-1]
        padded = np.zeros((len(rows), len(asked.layers), length, hidden), dtype=np.float32)
        mask = np.zeros((len(rows), length), dtype=bool)
        for i, (row, row_states) in enumerate(zip(rows, states)):
            for k, layer in enumerate(asked.layers):
                padded[i, k, :len(row.ids)] = row_states[layer]
            mask[i, :len(row.ids)] = row.residues
        outputs: dict[str, np.ndarray] = {}
        for pooling in POOLINGS:
            if pooling in asked.include:
                outputs[POOLED_OUTPUTS[pooling]] = pool(padded, mask[:, None, :], pooling)
        if PER_RESIDUE in asked.include:
            outputs["hiddens"], outputs["mask"] = padded, mask
        return outputs
