"""The files `bionemo-export client score` reads and writes: wild types in FASTA, variants in CSV.

A variants table is ProteinGym's DMS layout: a CSV with a `mutant` column (`A42G`, multi-mutants
`A42G:L43P`, 1-based positions) and any other columns (`DMS_score`, ...), which are kept as they
are; the scored table is the same CSV with one more column. Each row is scored against a wild
type from the FASTA file: its only record, or, when the file holds several, the record named in
the row's id column (`--id-column`).

The variants are checked by the server (N_scores), which names the variant in its error; this
module only reads, groups and writes.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from bionemo_export.errors import InvalidInputError

from .records import Record


@dataclass(frozen=True)
class VariantTable:
    """A variants CSV as read: its header and rows (each a list of cells, as written)."""

    path: Path
    header: list[str]
    rows: list[list[str]]
    mutant_column: int
    """Index of the column holding the variants."""

    def variants(self) -> list[str]:
        return [row[self.mutant_column] for row in self.rows]


def read_variant_table(path: Path, column: str = "mutant") -> VariantTable:
    """The CSV at `path`, whose header names `column`. ValueError naming the file and the line for
    a missing column, ragged rows, an empty variant or a file that is not UTF-8 CSV."""
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            lines = list(csv.reader(handle))
    except UnicodeDecodeError as err:
        raise InvalidInputError(f"{path}: not a UTF-8 text file ({err.reason} at byte {err.start})") from None
    except csv.Error as err:
        raise InvalidInputError(f"{path}: not a CSV file ({err})") from None
    if not lines:
        raise InvalidInputError(f"{path}: empty; expected a header with a {column!r} column")
    header, rows = lines[0], lines[1:]
    if column not in header:
        raise InvalidInputError(f"{path}: no {column!r} column (columns: {', '.join(header)}); name it with `column`")
    index = header.index(column)
    for number, row in enumerate(rows, start=2):
        if len(row) != len(header):
            raise InvalidInputError(f"{path}, line {number}: {len(row)} cells, the header has {len(header)}")
        if not row[index].strip():
            raise InvalidInputError(f"{path}, line {number}: the {column!r} cell is empty")
    return VariantTable(path, header, rows, index)


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
    for number, row in enumerate(table.rows, start=2):
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


def write_scored_table(table: VariantTable, scores: list[float], out: Path, score_column: str) -> Path:
    """`table` with `score_column` added (or replaced), one score per row, written to `out`
    through a temporary file (a failed write leaves no half-written table)."""
    if len(scores) != len(table.rows):
        raise ValueError(f"{len(scores)} scores for {len(table.rows)} rows")
    header = list(table.header)
    replace = score_column in header
    index = header.index(score_column) if replace else len(header)
    if not replace:
        header.append(score_column)
    out = Path(out)
    partial = out.with_name(f".{out.name}.partial")
    with partial.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for row, score in zip(table.rows, scores):
            row = list(row)
            text = repr(float(score))
            if replace:
                row[index] = text
            else:
                row.append(text)
            writer.writerow(row)
    partial.replace(out)
    return out
