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

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library, numpy and its sibling modules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .responses import RequestError, Responder, call_model
from .row_calls import (
    Outputs,
    Row,
    RowModel,
    batch_of,
    integer_option,
    one_value_per_request,
    padded_tokens,
    read_sequences,
)

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


def _text(name: str, value: Any) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"input '{name}' holds bytes that are not UTF-8: {value[:20]!r}") from None
    return str(value)


# ---------------------------------------------------------------------------- the model
@dataclass
class _Asked:
    layers: tuple[int, ...]
    """In the order asked (normalized)."""
    include: tuple[str, ...]


class LayerEmbeddings(RowModel):
    """The N_layers model: `tokenizer` the repository's (tokenizer.json), `run_graph` N_layer_graph
    (each call answering the layers asked), `num_layers` the encoder's blocks N, `has_bos` whether
    its rows start with a BOS/CLS token, `token_budget` and `max_rows` what one graph call holds."""

    inputs = ("sequences", "layers", "include")

    def __init__(self, tokenizer: Any, run_graph: RunGraph, *, num_layers: int, has_bos: bool, token_budget: int,
                 max_rows: int, responder: Responder) -> None:
        self.tokenizer, self.run_graph, self.responder = tokenizer, run_graph, responder
        self.num_layers, self.has_bos = int(num_layers), bool(has_bos)
        self.budget, self.max_rows = max(int(token_budget), 1), max(int(max_rows), 1)
        if self.num_layers < 1:
            raise ValueError(f"parameter num_layers is {self.num_layers}; a model has at least one block")

    def read(self, index: int, inputs: dict[str, np.ndarray | None]) -> tuple[list[Row], _Asked]:
        """The request's rows tokenized (their group: the distinct layers asked) and its choices;
        RequestError (or the tokenizer's error) naming the input and the value."""
        batch = batch_of(inputs)
        values = integer_option("layers", inputs.get("layers"), batch) if batch else None
        layers = (self.num_layers,) if values is None else normalize_layers(values, self.num_layers)
        include_column = inputs.get("include")
        if include_column is None or not batch:
            include = DEFAULT_INCLUDE
        else:
            chosen = one_value_per_request("include", np.asarray(include_column), batch)
            include = parse_include([_text("include", value) for value in chosen.tolist()], self.has_bos)
        rows = read_sequences(self.tokenizer, index, inputs.get("sequences"), tuple(sorted(set(layers))))
        return rows, _Asked(layers, include)

    def cost(self, rows: int, longest: int) -> int:
        """Tokens: rows x padded length."""
        return rows * longest

    def run(self, call: list[Row]) -> list[dict[int, np.ndarray]]:
        """Each row's {layer: states [len(ids), H]} from one graph call over the rows, padded to the
        longest, asking for their layers only."""
        input_ids, attention_mask = padded_tokens(call, self.tokenizer.pad_id)
        length, layers = input_ids.shape[1], call[0].group
        answered = [np.asarray(states, dtype=np.float32) for states in self.run_graph(input_ids, attention_mask,
                                                                                       layers)]
        if len(answered) != len(layers) or any(a.ndim != 3 or a.shape[:2] != (len(call), length) for a in answered):
            raise RuntimeError(f"the layers graph answered {[list(a.shape) for a in answered]} for layers "
                               f"{list(layers)} of {len(call)} rows of {length} tokens")
        return [{layer: states[i, :len(row.ids)] for layer, states in zip(layers, answered)}
                for i, row in enumerate(call)]

    def assemble(self, asked: _Asked, rows: list[Row], states: list[dict[int, np.ndarray]]) -> Outputs:
        """One request's outputs: its rows' states of the layers asked, in the order asked."""
        length = max(len(row.ids) for row in rows)
        hidden = next(iter(states[0].values())).shape[-1]
        padded = np.zeros((len(rows), len(asked.layers), length, hidden), dtype=np.float32)
        mask = np.zeros((len(rows), length), dtype=bool)
        for i, (row, row_states) in enumerate(zip(rows, states)):
            for k, layer in enumerate(asked.layers):
                padded[i, k, :len(row.ids)] = row_states[layer]
            mask[i, :len(row.ids)] = row.residues
        outputs: Outputs = {}
        for pooling in POOLINGS:
            if pooling in asked.include:
                outputs[POOLED_OUTPUTS[pooling]] = pool(padded, mask[:, None, :], pooling)
        if PER_RESIDUE in asked.include:
            outputs["hiddens"], outputs["mask"] = padded, mask
        return outputs
