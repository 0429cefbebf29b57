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

RunGraph = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""(input_ids, attention_mask INT64 [rows, T]) -> contacts FP32 [rows, T-2, T-2], as N_contact_graph answers."""

DEFAULT_PAIR_BUDGET = 1 << 20
"""Token pairs (rows x T^2) per graph call by default: one 1024-token sequence, or 64 of 128."""


def graph_caller(model_name: str) -> RunGraph:
    """The BLS call to the repository's N_contact_graph model."""
    def run(input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        (contacts,) = call_model(model_name, {"input_ids": input_ids, "attention_mask": attention_mask}, ["contacts"])
        return contacts
    return run


@dataclass
class _Row:
    request: int
    row: int
    ids: np.ndarray
    """The sequence's tokens (BOS + residues + EOS), unpadded."""
    residues: int


class ContactMaps:
    """The N_contacts model: `tokenizer` the repository's (tokenizer.json), `max_residues` the
    longest sequence it answers, `pair_budget` and `max_rows` what one graph call holds."""

    def __init__(self, tokenizer: Any, run_graph: RunGraph, *, max_residues: int, pair_budget: int, max_rows: int,
                 responder: Responder, limit_parameter: str = "max_residues") -> None:
        self.tokenizer, self.run_graph, self.responder = tokenizer, run_graph, responder
        self.max_residues, self.pair_budget, self.max_rows = int(max_residues), int(pair_budget), max(int(max_rows), 1)
        self.limit_parameter = limit_parameter
        model_limit = getattr(tokenizer, "max_residues", self.max_residues)
        if not 1 <= self.max_residues <= model_limit:
            raise ValueError(f"parameter {limit_parameter} is {self.max_residues}; it must lie in 1..{model_limit}, "
                             "the model's limit")

    def execute(self, requests: Sequence[Any]) -> tuple[list, int]:
        """(one response per request, bytes of work) for Responder.answer_all."""
        pb_utils = triton()
        maps, failures = self.answer([input_array(request, "sequences") for request in requests])
        responses, work = [], 0
        for index in range(len(requests)):
            if index in failures:
                responses.append(self.responder.error_response(failures[index]))
                continue
            contacts, mask = maps[index]
            work += contacts.nbytes
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("contacts", contacts),
                                                         pb_utils.Tensor("mask", mask)]))
        return responses, work

    def answer(self, columns: Sequence[np.ndarray | None]
               ) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]], dict[int, BaseException]]:
        """({request: (contacts [rows, L, L], mask [rows, L])}, {request: its error}) for the
        requests' `sequences` columns: a request's bad input or a failed graph call fails that
        request (those in the call) alone."""
        failures: dict[int, BaseException] = {}
        rows: list[_Row] = []
        counts: dict[int, int] = {}
        for index, column in enumerate(columns):
            try:
                found = self.read(index, column)
            except Exception as err:  # noqa: BLE001 - this request fails alone
                failures[index] = err
                continue
            counts[index] = len(found)
            rows += found
        maps: dict[tuple[int, int], np.ndarray] = {}
        for call in self.calls(rows):
            call = [row for row in call if row.request not in failures]
            if not call:
                continue
            try:
                answered = self.run(call)
            except Exception as err:  # noqa: BLE001 - the requests of this call fail, the others go on
                failures.update({row.request: err for row in call})
                continue
            maps.update({(row.request, row.row): contacts for row, contacts in zip(call, answered)})
        answers = {}
        for index, count in counts.items():
            if index not in failures:
                answers[index] = self.assemble([maps[(index, row)] for row in range(count)])
        return answers, failures

    def read(self, index: int, column: np.ndarray | None) -> list[_Row]:
        """The request's sequences tokenized; RequestError (or the tokenizer's error) naming the row."""
        if column is None or column.ndim != 2 or column.shape[1] != 1 or not column.shape[0]:
            shape = None if column is None else list(column.shape)
            raise RequestError(f"input 'sequences' must have shape [batch, 1] with batch >= 1, got {shape}")
        sequences = [value if isinstance(value, bytes) else str(value).encode("utf-8") for value in column[:, 0]]
        for row, sequence in enumerate(sequences):
            if len(sequence) > self.max_residues:
                raise RequestError(
                    f"sequence {row} has {len(sequence)} residues; contact maps are answered for at most "
                    f"{self.max_residues} (config parameter {self.limit_parameter}: the attention of every layer "
                    f"grows with the length squared): split the protein, or raise the parameter within the "
                    f"model's limit")
        encoded = self.tokenizer.encode(sequences)
        found = []
        for row in range(len(sequences)):
            tokens = encoded.attention_mask[row].astype(bool)
            found.append(_Row(index, row, encoded.input_ids[row][tokens], int(encoded.residue_mask[row].sum())))
        return found

    def calls(self, rows: list[_Row]) -> list[list[_Row]]:
        """The rows sorted by length, cut into graph calls of at most max_rows rows and pair_budget
        token pairs (a row alone may exceed the budget)."""
        calls: list[list[_Row]] = []
        for row in sorted(rows, key=lambda r: len(r.ids)):
            if calls:
                current = calls[-1]
                longest = max(len(row.ids), len(current[-1].ids))
                if len(current) < self.max_rows and (len(current) + 1) * longest * longest <= self.pair_budget:
                    current.append(row)
                    continue
            calls.append([row])
        return calls

    def run(self, call: list[_Row]) -> list[np.ndarray]:
        """Each row's [L, L] map from one graph call over the rows, padded to the longest."""
        length = max(len(row.ids) for row in call)
        input_ids = np.full((len(call), length), self.tokenizer.pad_id, dtype=np.int64)
        attention_mask = np.zeros((len(call), length), dtype=np.int64)
        for i, row in enumerate(call):
            input_ids[i, :len(row.ids)] = row.ids
            attention_mask[i, :len(row.ids)] = 1
        contacts = np.asarray(self.run_graph(input_ids, attention_mask), dtype=np.float32)
        if contacts.shape != (len(call), length - 2, length - 2):
            raise RuntimeError(f"the contact graph answered {list(contacts.shape)} for {len(call)} rows of "
                               f"{length} tokens")
        return [contacts[i, :row.residues, :row.residues] for i, row in enumerate(call)]

    @staticmethod
    def assemble(maps: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(contacts [rows, L, L] padded with 0, mask [rows, L]) of one request's maps."""
        longest = max(len(m) for m in maps)
        contacts = np.zeros((len(maps), longest, longest), dtype=np.float32)
        mask = np.zeros((len(maps), longest), dtype=bool)
        for i, m in enumerate(maps):
            contacts[i, :len(m), :len(m)] = m
            mask[i, :len(m)] = True
        return contacts, mask
