"""Python models that answer one sequence per request row through a graph model called by BLS:
N_contacts, N_layers, N_attentions (contacts.py, layers.py, attentions.py).

Each of them tokenizes the rows of every request the dynamic batcher hands over, sorts them by
length, cuts them into graph calls bounded by rows and by a cost budget (tokens, or token pairs
for the attention-sized graphs), runs the calls, and assembles each request's answer from its
rows. What is shared lives here, once:

- `RowModel.answer`: a request's bad input fails that request alone, and a failed graph call fails
  only the requests whose rows it held; every other request is answered;
- `RowModel.calls`: the length-sorted cut into calls (rows of one call share their `group`, e.g.
  the layers their request asks for);
- `read_sequences`, `padded_tokens`: the `sequences` column tokenized, and a call's rows padded.

A model subclasses RowModel and says how it reads a request, what a call costs, how it runs one
and how it assembles a request's outputs.

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library, numpy and its sibling modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .responses import RequestError, Responder, input_array, triton

Outputs = dict[str, np.ndarray]
"""A request's answer: its outputs by name."""

DEFAULT_PAIR_BUDGET = 1 << 20
"""Token pairs (rows x T^2) per call of an attention-sized graph by default: one 1024-token
sequence, or 64 of 128."""


@dataclass
class Row:
    """One sequence of one request, tokenized."""

    request: int
    row: int
    ids: np.ndarray
    """Its tokens (BOS, residues, EOS as the tokenizer writes them), unpadded."""
    residues: np.ndarray
    """True on its residues, [len(ids)]."""
    group: tuple = ()
    """Rows of one graph call share it (N_layers: the layers their request asks for)."""


def read_sequences(tokenizer: Any, index: int, column: np.ndarray | None, group: tuple = ()) -> list[Row]:
    """Request `index`'s `sequences` column [batch, 1] tokenized, one Row per sequence; RequestError
    for a wrongly shaped column (the tokenizer's own error names a bad sequence's row)."""
    if column is None or column.ndim != 2 or column.shape[1] != 1 or not column.shape[0]:
        shape = None if column is None else list(column.shape)
        raise RequestError(f"input 'sequences' must have shape [batch, 1] with batch >= 1, got {shape}")
    sequences = [value if isinstance(value, bytes) else str(value).encode("utf-8") for value in column[:, 0]]
    encoded = tokenizer.encode(sequences)
    rows = []
    for row in range(len(sequences)):
        tokens = np.asarray(encoded.attention_mask[row]).astype(bool)
        rows.append(Row(index, row, np.asarray(encoded.input_ids[row])[tokens],
                        np.asarray(encoded.residue_mask[row]).astype(bool)[tokens], group))
    return rows


def padded_tokens(call: Sequence[Row], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) INT64 [rows, T] of a call's rows, padded to the longest (T)."""
    length = max(len(row.ids) for row in call)
    input_ids = np.full((len(call), length), pad_id, dtype=np.int64)
    attention_mask = np.zeros((len(call), length), dtype=np.int64)
    for i, row in enumerate(call):
        input_ids[i, :len(row.ids)] = row.ids
        attention_mask[i, :len(row.ids)] = 1
    return input_ids, attention_mask


def one_value_per_request(name: str, column: np.ndarray, batch: int) -> np.ndarray:
    """Row 0 of a [batch, K] option, checked to be the same on every row."""
    if column.ndim != 2 or column.shape[0] != batch or not column.shape[1]:
        raise RequestError(f"input '{name}' must have shape [batch, K] = [{batch}, K >= 1] (the same on every row "
                           f"of 'sequences'), got {list(column.shape)}")
    for row in range(1, batch):
        if not np.array_equal(column[row], column[0]):
            raise RequestError(f"input '{name}' row {row} differs from row 0 ({column[row].tolist()} vs "
                               f"{column[0].tolist()}): one choice for the whole request")
    return column[0]


def integer_option(name: str, column: np.ndarray | None, batch: int) -> list[int] | None:
    """An optional INT32 [batch, K] option's K values (the same on every row), None when absent."""
    if column is None:
        return None
    values = one_value_per_request(name, np.asarray(column), batch)
    if values.dtype.kind not in "iu":
        raise RequestError(f"input '{name}' must hold integers (INT32), got {values.dtype}")
    return [int(value) for value in values.tolist()]


def batch_of(inputs: dict[str, np.ndarray | None]) -> int:
    """The request's rows, as its `sequences` column says (0 when it is missing or misshaped: the
    tokenizing step then names the problem)."""
    column = inputs.get("sequences")
    return column.shape[0] if column is not None and column.ndim == 2 else 0


class RowModel:
    """A Python model answering one sequence per request row through graph calls; subclasses set
    `responder`, `max_rows`, `budget` and `inputs` and define read, cost, run and assemble."""

    responder: Responder
    max_rows: int
    """Most rows in one graph call."""
    budget: int
    """Most `cost` of one graph call (a row alone may exceed it)."""
    inputs: tuple[str, ...] = ("sequences",)
    """The request inputs `read` gets (an optional one absent: None)."""

    def read(self, index: int, inputs: dict[str, np.ndarray | None]) -> tuple[list[Row], Any]:
        """Request `index`'s rows and what it asks for (handed back to assemble); raises what fails it."""
        raise NotImplementedError

    def cost(self, rows: int, longest: int) -> int:
        """What a call of `rows` rows padded to `longest` tokens costs, against `budget`."""
        raise NotImplementedError

    def run(self, call: list[Row]) -> list[Any]:
        """One graph call over `call`'s rows: each row's result, in order."""
        raise NotImplementedError

    def assemble(self, asked: Any, rows: list[Row], results: list[Any]) -> Outputs:
        """One request's outputs from its rows (in order) and their results."""
        raise NotImplementedError

    def execute(self, requests: Sequence[Any]) -> tuple[list, int]:
        """(one response per request, bytes of work) for Responder.answer_all."""
        pb_utils = triton()
        answers, failures = self.answer([{name: input_array(request, name) for name in self.inputs}
                                         for request in requests])
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
               ) -> tuple[dict[int, Outputs], dict[int, BaseException]]:
        """({request: its outputs}, {request: its error}) for the requests' input arrays: a request's
        bad input fails it alone; a failed graph call fails the requests whose rows it held, and the
        other requests go on."""
        failures: dict[int, BaseException] = {}
        asked: dict[int, Any] = {}
        rows: dict[int, list[Row]] = {}
        for index, inputs in enumerate(requests):
            try:
                rows[index], asked[index] = self.read(index, inputs)
            except Exception as err:  # noqa: BLE001 - this request fails alone
                failures[index] = err
        results: dict[tuple[int, int], Any] = {}
        for call in self.calls([row for found in rows.values() for row in found]):
            call = [row for row in call if row.request not in failures]
            if not call:
                continue
            try:
                answered = self.run(call)
            except Exception as err:  # noqa: BLE001 - the requests of this call fail, the others go on
                failures.update({row.request: err for row in call})
                continue
            results.update({(row.request, row.row): result for row, result in zip(call, answered)})
        answers = {}
        for index, found in rows.items():
            if index not in failures:
                try:
                    answers[index] = self.assemble(asked[index], found,
                                                   [results[(index, row.row)] for row in found])
                except Exception as err:  # noqa: BLE001 - this request fails alone
                    failures[index] = err
        return answers, failures

    def calls(self, rows: list[Row]) -> list[list[Row]]:
        """The rows grouped by `group`, sorted by length, cut into graph calls of at most max_rows
        rows and `budget` cost (a row alone may exceed the budget)."""
        calls: list[list[Row]] = []
        for row in sorted(rows, key=lambda r: (r.group, len(r.ids))):
            if calls:
                current = calls[-1]
                longest = max(len(row.ids), len(current[-1].ids))
                if current[-1].group == row.group and len(current) < self.max_rows \
                        and self.cost(len(current) + 1, longest) <= self.budget:
                    current.append(row)
                    continue
            calls.append([row])
        return calls
