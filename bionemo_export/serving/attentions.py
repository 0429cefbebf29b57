"""N_attentions run by the Python backend: the attention probabilities of the blocks and heads each
request asks for, from the repository's attentions graph (N_attention_graph: the encoder with eager
attention answering every block's probabilities as separate outputs `attentions_1` ..
`attentions_N`, transformers' `output_attentions`).

Each request row is one sequence (`sequences` [batch, 1]); optional `layers` INT32 [batch, K] and
`heads` INT32 [batch, K'] (each the same on every row) choose what it answers:

- layers: the blocks 1..N (block i's attention, the block whose output N_layers calls layer i; the
  embedding layer, 0, has none), negative from the end (-1 is N); default the last; several at
  once, answered in the order asked.
- heads: 0..heads-1, negative from the end; default every head, in order.

Answers `attentions` FP32 [batch, K, K', T, T] (query rows, key columns; T the request's longest
tokenized sequence, BOS and EOS included as N_hiddens lays tokens out, 0 past each sequence's own
tokens) and `mask` BOOL [batch, T] (True on the residues).

An answer holds batch x K x K' x T^2 values: a request over `max_attention_values` fails alone with
INVALID_ARGUMENT naming its size and the limit (a config parameter), as does a block or head out of
range (naming the range). The rows of every request the dynamic batcher hands over are tokenized
here, grouped by the blocks they need and sorted by length, and sent to N_attention_graph through
BLS in calls of at most `max_rows` rows and `pair_budget` token pairs (rows x T^2, which bounds the
probabilities the graph holds), each call asking only for its rows' blocks: the others never leave
the graph model.

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
    padded_tokens,
    read_sequences,
)

RunGraph = Callable[[np.ndarray, np.ndarray, Sequence[int]], Sequence[np.ndarray]]
"""(input_ids, attention_mask INT64 [rows, T], blocks) -> each block's probabilities FP32
[rows, heads, T, T], as N_attention_graph answers its outputs attentions_<block>."""


def attention_output_name(layer: int) -> str:
    """N_attention_graph's output holding block `layer` (models/attention_maps.py names them the same)."""
    return f"attentions_{layer}"


def graph_caller(model_name: str) -> RunGraph:
    """The BLS call to the repository's N_attention_graph model, asking for `layers` only."""
    def run(input_ids: np.ndarray, attention_mask: np.ndarray, layers: Sequence[int]) -> list[np.ndarray]:
        return call_model(model_name, {"input_ids": input_ids, "attention_mask": attention_mask},
                          [attention_output_name(layer) for layer in layers])
    return run


def normalize_blocks(values: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """The blocks asked for as 1..num_layers (negative counted from the end), in the order asked;
    RequestError naming a value outside the range (0 too: the embedding layer has no attention)."""
    allowed = f"1..{num_layers} or -{num_layers}..-1 counted from the end"
    if not len(values):
        raise RequestError(f"input 'layers' is empty; name at least one block: {allowed}")
    blocks = []
    for value in values:
        if value == 0:
            raise RequestError(f"input 'layers' value 0 is the embedding layer, which has no attention; this "
                               f"model's blocks are {allowed}")
        if not -num_layers <= value <= num_layers:
            raise RequestError(f"input 'layers' value {value} is out of range: this model's blocks are {allowed}")
        blocks.append(value if value > 0 else num_layers + 1 + value)
    return tuple(blocks)


def normalize_heads(values: Sequence[int], num_heads: int) -> tuple[int, ...]:
    """The heads asked for as 0..num_heads-1 (negative counted from the end), in the order asked;
    RequestError naming a value outside the range."""
    allowed = f"0..{num_heads - 1} or -{num_heads}..-1 counted from the end"
    if not len(values):
        raise RequestError(f"input 'heads' is empty; name at least one head: {allowed}")
    for value in values:
        if not -num_heads <= value < num_heads:
            raise RequestError(f"input 'heads' value {value} is out of range: this model's heads are {allowed}")
    return tuple(value % num_heads for value in values)


@dataclass
class _Asked:
    layers: tuple[int, ...]
    """Blocks 1..N, in the order asked."""
    heads: tuple[int, ...]


class AttentionWeights(RowModel):
    """The N_attentions model: `tokenizer` the repository's (tokenizer.json), `run_graph`
    N_attention_graph (each call answering the blocks asked), `num_layers` and `num_heads` the
    encoder's, `max_values` the largest answer a request gets, `pair_budget` and `max_rows` what
    one graph call holds."""

    inputs = ("sequences", "layers", "heads")

    def __init__(self, tokenizer: Any, run_graph: RunGraph, *, num_layers: int, num_heads: int, max_values: int,
                 pair_budget: int, max_rows: int, responder: Responder) -> None:
        self.tokenizer, self.run_graph, self.responder = tokenizer, run_graph, responder
        self.num_layers, self.num_heads, self.max_values = int(num_layers), int(num_heads), int(max_values)
        self.budget, self.max_rows = max(int(pair_budget), 1), max(int(max_rows), 1)
        if self.num_layers < 1 or self.num_heads < 1:
            raise ValueError(f"parameters num_layers {self.num_layers} and num_heads {self.num_heads}: a model has "
                             "at least one block of one head")
        if self.max_values < 1:
            raise ValueError(f"parameter max_attention_values is {self.max_values}; it must be at least 1")

    def read(self, index: int, inputs: dict[str, np.ndarray | None]) -> tuple[list[Row], _Asked]:
        """The request's rows tokenized (their group: the distinct blocks asked) and its choices;
        RequestError naming a value out of range, or an answer over max_values."""
        batch = batch_of(inputs)
        layers = integer_option("layers", inputs.get("layers"), batch) if batch else None
        heads = integer_option("heads", inputs.get("heads"), batch) if batch else None
        blocks = (self.num_layers,) if layers is None else normalize_blocks(layers, self.num_layers)
        chosen = tuple(range(self.num_heads)) if heads is None else normalize_heads(heads, self.num_heads)
        rows = read_sequences(self.tokenizer, index, inputs.get("sequences"), tuple(sorted(set(blocks))))
        longest = max(len(row.ids) for row in rows)
        size = len(rows) * len(blocks) * len(chosen) * longest * longest
        if size > self.max_values:
            raise RequestError(
                f"the answer would hold {size:,} attention values ({len(rows)} sequences x {len(blocks)} blocks x "
                f"{len(chosen)} heads x {longest}^2 token pairs); this model answers at most {self.max_values:,} "
                f"per request (config parameter max_attention_values): ask for fewer blocks or heads (inputs "
                f"'layers', 'heads'), or fewer or shorter sequences per request")
        return rows, _Asked(blocks, chosen)

    def cost(self, rows: int, longest: int) -> int:
        """Token pairs: the probabilities a call holds grow with rows x length^2."""
        return rows * longest * longest

    def run(self, call: list[Row]) -> list[dict[int, np.ndarray]]:
        """Each row's {block: probabilities [heads, len(ids), len(ids)]} from one graph call over
        the rows, padded to the longest, asking for their blocks only."""
        input_ids, attention_mask = padded_tokens(call, self.tokenizer.pad_id)
        length, blocks = input_ids.shape[1], call[0].group
        answered = [np.asarray(a, dtype=np.float32) for a in self.run_graph(input_ids, attention_mask, blocks)]
        expected = (len(call), self.num_heads, length, length)
        if len(answered) != len(blocks) or any(a.shape != expected for a in answered):
            raise RuntimeError(f"the attentions graph answered {[list(a.shape) for a in answered]} for blocks "
                               f"{list(blocks)}; expected {list(expected)} each")
        return [{block: probabilities[i, :, :len(row.ids), :len(row.ids)] for block, probabilities in
                 zip(blocks, answered)} for i, row in enumerate(call)]

    def assemble(self, asked: _Asked, rows: list[Row], results: list[dict[int, np.ndarray]]) -> Outputs:
        """One request's outputs: its rows' probabilities of the blocks and heads asked, in the
        order asked, padded with 0 to its longest sequence."""
        length = max(len(row.ids) for row in rows)
        heads = list(asked.heads)
        attentions = np.zeros((len(rows), len(asked.layers), len(heads), length, length), dtype=np.float32)
        mask = np.zeros((len(rows), length), dtype=bool)
        for i, (row, found) in enumerate(zip(rows, results)):
            tokens = len(row.ids)
            for k, block in enumerate(asked.layers):
                attentions[i, k, :, :tokens, :tokens] = found[block][heads]
            mask[i, :tokens] = row.residues
        return {"attentions": attentions, "mask": mask}
