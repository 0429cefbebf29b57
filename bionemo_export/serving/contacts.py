"""N_contacts run by the Python backend: each sequence's [L, L] residue-residue contact
probabilities from the repository's contact graph (N_contact_graph: the encoder run with every
layer's attention probabilities into ESM's contact head).

Each request row is one sequence (`sequences` [batch, 1]). The rows of every request the dynamic
batcher hands over are tokenized here (a bad character or an empty sequence fails its request alone
with INVALID_ARGUMENT naming the row), checked against `max_residues` (a longer one fails its
request with INVALID_ARGUMENT naming its length and the limit), then sorted by length and sent to
N_contact_graph through BLS in calls of at most `max_rows` rows and `pair_budget` token pairs
(rows x padded length^2, which bounds the attention the graph holds; a row alone may exceed it).
The graph answers [rows, T-2, T-2]: row and column i of a sequence's map are its residue i, and the
sequence's own [L, L] block does not depend on what it was padded with.

Answers `contacts` FP32 [batch, L, L] (L: the request's longest sequence; shorter ones padded with
0) and `mask` BOOL [batch, L] (True on each sequence's residues).

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library, numpy and its sibling modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .responses import RequestError, Responder, call_model
from .row_calls import Outputs, Row, RowModel, padded_tokens, read_sequences

RunGraph = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""(input_ids, attention_mask INT64 [rows, T]) -> contacts FP32 [rows, T-2, T-2], as N_contact_graph answers."""


def graph_caller(model_name: str) -> RunGraph:
    """The BLS call to the repository's N_contact_graph model."""
    def run(input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        (contacts,) = call_model(model_name, {"input_ids": input_ids, "attention_mask": attention_mask}, ["contacts"])
        return contacts
    return run


class ContactMaps(RowModel):
    """The N_contacts model: `tokenizer` the repository's (tokenizer.json), `max_residues` the
    longest sequence it answers, `pair_budget` and `max_rows` what one graph call holds."""

    def __init__(self, tokenizer: Any, run_graph: RunGraph, *, max_residues: int, pair_budget: int, max_rows: int,
                 responder: Responder, limit_parameter: str = "max_residues") -> None:
        self.tokenizer, self.run_graph, self.responder = tokenizer, run_graph, responder
        self.max_residues, self.budget, self.max_rows = int(max_residues), int(pair_budget), max(int(max_rows), 1)
        self.limit_parameter = limit_parameter
        model_limit = getattr(tokenizer, "max_residues", self.max_residues)
        if not 1 <= self.max_residues <= model_limit:
            raise ValueError(f"parameter {limit_parameter} is {self.max_residues}; it must lie in 1..{model_limit}, "
                             "the model's limit")

    def read(self, index: int, inputs: dict[str, np.ndarray | None]) -> tuple[list[Row], None]:
        """The request's sequences tokenized; RequestError (or the tokenizer's error) naming the row."""
        column = inputs.get("sequences")
        if column is not None and column.ndim == 2:
            for row, value in enumerate(column[:, 0] if column.shape[1:] == (1,) else ()):
                length = len(value if isinstance(value, bytes) else str(value).encode("utf-8"))
                if length > self.max_residues:
                    raise RequestError(
                        f"sequence {row} has {length} residues; contact maps are answered for at most "
                        f"{self.max_residues} (config parameter {self.limit_parameter}: the attention of every "
                        f"layer grows with the length squared): split the protein, or raise the parameter within "
                        f"the model's limit")
        return read_sequences(self.tokenizer, index, column), None

    def cost(self, rows: int, longest: int) -> int:
        """Token pairs: the attention a call holds grows with rows x length^2."""
        return rows * longest * longest

    def run(self, call: list[Row]) -> list[np.ndarray]:
        """Each row's [L, L] map from one graph call over the rows, padded to the longest."""
        input_ids, attention_mask = padded_tokens(call, self.tokenizer.pad_id)
        length = input_ids.shape[1]
        contacts = np.asarray(self.run_graph(input_ids, attention_mask), dtype=np.float32)
        if contacts.shape != (len(call), length - 2, length - 2):
            raise RuntimeError(f"the contact graph answered {list(contacts.shape)} for {len(call)} rows of "
                               f"{length} tokens")
        return [contacts[i, :count, :count] for i, count in enumerate(int(row.residues.sum()) for row in call)]

    def assemble(self, asked: None, rows: list[Row], maps: list[np.ndarray]) -> Outputs:
        """contacts [rows, L, L] padded with 0 and mask [rows, L] of one request's maps."""
        longest = max(len(m) for m in maps)
        contacts = np.zeros((len(maps), longest, longest), dtype=np.float32)
        mask = np.zeros((len(maps), longest), dtype=bool)
        for i, m in enumerate(maps):
            contacts[i, :len(m), :len(m)] = m
            mask[i, :len(m)] = True
        return {"contacts": contacts, "mask": mask}
