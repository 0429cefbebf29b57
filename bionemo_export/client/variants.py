"""The files `bionemo-export client score` reads and writes: wild types in FASTA, variants in CSV.

A variants table is ProteinGym's DMS layout: a CSV with a `mutant` column (`A42G`, multi-mutants
`A42G:L43P`, 1-based positions) and any other columns (`DMS_score`, ...), which are kept as they
are; the scored table is the same CSV with one more column (and one per member with a checkpoint
ensemble's members' scores: `member_columns`). Each row is scored against a wild
type from the FASTA file: its only record, or, when the file holds several, the record named in
the row's id column (`--id-column`).

The variants are checked by the server (N_scores), which names the variant in its error; this
module only reads, groups and writes.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bionemo_export.errors import InvalidInputError

from .job_files import Journal, durable_replace, file_identity
from .job_lock import LocalOutputLock
from .records import Record


@dataclass(frozen=True)
class VariantTable:
    """A variants CSV as read: its header and rows (each a list of cells, as written)."""

    path: Path
    header: list[str]
    rows: list[list[str]]
    mutant_column: int
    """Index of the column holding the variants."""
    first_line: int = 2
    """The file's line number of the first row (a chunk of a file read in pieces starts later)."""

    def variants(self) -> list[str]:
        return [row[self.mutant_column] for row in self.rows]


ROWS_PER_CHUNK = 50_000
"""Rows `client score` holds at a time: a few MB; each wild type's rows of a chunk go to the server
together (in requests of its max_variants)."""


def read_variant_table(path: Path, column: str = "mutant") -> VariantTable:
    """The whole CSV at `path` (see `iter_variant_tables` for what is checked)."""
    chunks = list(iter_variant_tables(path, column))
    rows = [row for chunk in chunks for row in chunk.rows]
    return VariantTable(chunks[0].path, chunks[0].header, rows, chunks[0].mutant_column)


def iter_variant_tables(path: Path, column: str = "mutant", rows: int | None = None) -> Iterator[VariantTable]:
    """The CSV at `path` (`.gz` read directly) as tables of at most `rows` rows each (default
    ROWS_PER_CHUNK), read as it goes: a file of any length is never held whole. Its header must
    name `column`. ValueError naming the file and the line for a missing column, ragged rows, an
    empty variant or a file that is not UTF-8 CSV; a file with no rows is one empty table."""
    path, rows = Path(path), rows or ROWS_PER_CHUNK
    opened = gzip.open(path, "rt", newline="", encoding="utf-8") if path.name.endswith(".gz") else \
        path.open(newline="", encoding="utf-8")
    try:
        with opened as handle:
            reader = csv.reader(handle)
            header = next(reader, None)
            if header is None:
                raise InvalidInputError(f"{path}: empty; expected a header with a {column!r} column")
            if column not in header:
                raise InvalidInputError(f"{path}: no {column!r} column (columns: {', '.join(header)}); name it "
                                        "with `column`")
            index = header.index(column)
            chunk: list[list[str]] = []
            first = 2
            for number, row in enumerate(reader, start=2):
                if len(row) != len(header):
                    raise InvalidInputError(f"{path}, line {number}: {len(row)} cells, the header has {len(header)}")
                if not row[index].strip():
                    raise InvalidInputError(f"{path}, line {number}: the {column!r} cell is empty")
                chunk.append(row)
                if len(chunk) == rows:
                    yield VariantTable(path, header, chunk, index, first)
                    chunk, first = [], number + 1
            if chunk or first == 2:
                yield VariantTable(path, header, chunk, index, first)
    except UnicodeDecodeError as err:
        raise InvalidInputError(f"{path}: not a UTF-8 text file ({err.reason} at byte {err.start})") from None
    except csv.Error as err:
        raise InvalidInputError(f"{path}: not a CSV file ({err})") from None


def wild_type_of_rows(table: VariantTable, records: list[Record], id_column: str | None) -> list[str]:
    """The wild-type sequence of each row: the FASTA's only record, else the record whose id is in
    the row's `id_column`. ValueError naming what is missing."""
    if not records:
        raise InvalidInputError("the FASTA file holds no sequence")
    if len(records) == 1 and id_column is None:
        return [records[0].sequence] * len(table.rows)
    if id_column is None:
        raise InvalidInputError(f"the FASTA file holds {len(records)} sequences: name the {table.path} column that "
                                "says which one each row mutates with `id_column`")
    if id_column not in table.header:
        raise InvalidInputError(f"{table.path}: no {id_column!r} column (columns: {', '.join(table.header)})")
    by_id = {record.id: record.sequence for record in records}
    index = table.header.index(id_column)
    sequences = []
    for number, row in enumerate(table.rows, start=table.first_line):
        if row[index] not in by_id:
            raise InvalidInputError(f"{table.path}, line {number}: {row[index]!r} is not a record of the FASTA file "
                                    f"(records: {', '.join(list(by_id)[:5])}{', ...' if len(by_id) > 5 else ''})")
        sequences.append(by_id[row[index]])
    return sequences


def group_by_wild_type(wild_types: list[str]) -> dict[str, list[int]]:
    """Row indices by wild type, in first-seen order: each group is scored in requests of its own."""
    groups: dict[str, list[int]] = {}
    for index, sequence in enumerate(wild_types):
        groups.setdefault(sequence, []).append(index)
    return groups


def member_columns(score_column: str, members: int) -> list[str]:
    """The columns of a checkpoint ensemble's members' scores beside the mean's `score_column`:
    `<score_column>_member1` ... `_member<K>`, in the build's order of the members."""
    return [f"{score_column}_member{number}" for number in range(1, members + 1)]


class ScoredTableWriter:
    """The scored CSV, written as its chunks are scored: the input's columns with `score_column`
    added (or replaced; several: each), through a temporary file renamed into place at the end
    (never a half-written table under the output's name).

        with ScoredTableWriter(out, header, "wt-marginal_score", fingerprint=run) as writer:
            for table in iter_variant_tables(path):
                if writer.skips(table):
                    continue
                writer.write(table, scores_of(table))

    With a `fingerprint` (what makes two runs the same run) the writer is resumable: each chunk
    written is recorded in a journal beside the output (`.<name>.journal.jsonl`: the rows done and
    the temporary file's length then, after an fsync), a stopped run keeps both, and the same run
    started again cuts the temporary file back to the last recorded chunk and skips the rows
    before it (`skips`): every row once, as in an uninterrupted run. Another run's journal is
    refused, naming what differs. Without one, a failed run removes its temporary file. One run at a
    time writes an output: a second refuses at once (JobLockedError naming the holder: the lock
    file `.<name>.lock` beside it, held from enter to exit).
    """

    def __init__(self, out: Path, header: list[str], score_column: str | Sequence[str],
                 fingerprint: dict[str, Any] | None = None) -> None:
        self.out = Path(out)
        self.partial = self.out.with_name(f".{self.out.name}.partial")
        self.lock = LocalOutputLock(self.out.with_name(f".{self.out.name}.lock"))
        self.journal_path = self.out.with_name(f".{self.out.name}.journal.jsonl")
        self.fingerprint = fingerprint
        columns = [score_column] if isinstance(score_column, str) else list(score_column)
        if len(set(columns)) != len(columns) or not columns:
            raise ValueError(f"score columns {columns}: give at least one, each once")
        self.header = list(header) + [column for column in columns if column not in header]
        self.indices = [self.header.index(column) for column in columns]
        """Where each score column's cells go in a written row (an input column of that name is replaced)."""
        self.rows = 0
        self.resumed_rows = 0
        """Rows an earlier run of the same command had written."""
        self._seen = 0

    def __enter__(self) -> ScoredTableWriter:
        self.lock.__enter__()  # before the partial table or the journal is touched
        try:
            return self._open()
        except BaseException:
            self.lock.__exit__()
            raise

    def _open(self) -> ScoredTableWriter:
        journal = None
        if self.fingerprint is not None:
            if not self.partial.is_file():
                self.journal_path.unlink(missing_ok=True)  # a journal without its table: start afresh
            journal = Journal(self.journal_path)
            journal.start(self.fingerprint)
        done = journal.parts[-1] if journal is not None and journal.parts else None
        if done is not None:
            with self.partial.open("r+b") as handle:
                handle.truncate(done["bytes"])  # what a stopped run wrote after its last recorded chunk
            self.rows = self.resumed_rows = done["rows"]
            self._handle = self.partial.open("a", newline="", encoding="utf-8")
            self._writer = csv.writer(self._handle)
        else:
            self._handle = self.partial.open("w", newline="", encoding="utf-8")
            self._writer = csv.writer(self._handle)
            self._writer.writerow(self.header)
        self._journal = journal
        return self

    def skips(self, table: VariantTable) -> bool:
        """Whether `table` (the next chunk of the input, in order) was written by an earlier run."""
        self._seen += len(table.rows)
        return self._seen <= self.resumed_rows

    def write(self, table: VariantTable, scores: Sequence[float] | Sequence[Sequence[float]] | np.ndarray) -> None:
        """`table`'s rows with their scores: one per row (one score column), or a row of one per
        score column, in the columns' order."""
        values = np.asarray(scores, dtype=np.float64)
        values = values[:, None] if values.ndim == 1 else values
        if values.shape != (len(table.rows), len(self.indices)):
            raise ValueError(f"scores of shape {list(values.shape)} for {len(table.rows)} rows and "
                             f"{len(self.indices)} score columns")
        width = len(self.header)
        for row, cells in zip(table.rows, values.tolist(), strict=True):
            row = [*row, *[""] * (width - len(row))]
            for index, score in zip(self.indices, cells, strict=True):
                row[index] = repr(float(score))
            self._writer.writerow(row)
        self.rows += len(table.rows)
        if self._journal is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._journal.add({"rows": self.rows, "bytes": os.fstat(self._handle.fileno()).st_size})

    def __exit__(self, kind: object, error: object, traceback: object) -> None:
        try:
            self._handle.close()
            if kind is None:
                durable_replace(self.partial, self.out)
                self.journal_path.unlink(missing_ok=True)
            elif self._journal is None:
                self.partial.unlink(missing_ok=True)
        finally:
            self.lock.__exit__()


def score_fingerprint(model: str, model_config: dict[str, Any], fasta: Path, variants: Path, **options: Any
                      ) -> dict[str, Any]:
    """What makes two `client score` runs the same run (a resume must match it): the model and its
    served configuration, both input files and the options (the chunk size among them)."""
    config = json.dumps(model_config, sort_keys=True).encode()
    table = {f"variants_{key}": value for key, value in file_identity(Path(variants)).items()}
    return {"model": model, "model_config_sha256": hashlib.sha256(config).hexdigest(),
            "fasta": str(Path(fasta).resolve()), "fasta_sha256": hashlib.sha256(Path(fasta).read_bytes()).hexdigest(),
            "variants": str(Path(variants).resolve()), **table, **options}


def write_scored_table(table: VariantTable, scores: list[float], out: Path, score_column: str) -> Path:
    """`table` with `score_column` added (or replaced), one score per row, written to `out`
    through a temporary file (a failed write leaves no half-written table)."""
    with ScoredTableWriter(out, table.header, score_column) as writer:
        writer.write(table, scores)
    return Path(out)
