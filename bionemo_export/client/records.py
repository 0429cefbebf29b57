"""Input records, read as a stream: a file of any size is read a line at a time, never whole.

Three forms, told apart by the first line that is not blank or a comment:
- FASTA (it starts with '>'): the id is the header's first word; sequence lines are joined
  without spaces; ';' and '#' lines inside are comments.
- CSV or TSV with a header row naming a sequence column (`sequence`, `seq`, `smiles`, `protein`,
  or the one `--sequence-column` names) and optionally an id column (`id`, `name`, `accession`):
  the separator is a tab when the header has one, else a comma.
- One record per line: `SEQUENCE [ID]`, the id defaulting to `line<N>` (`.smi` files).

A name ending in `.gz` is read through gzip. `shard=(i, n)` keeps the records whose position in
the file (0-based, counting every record) is i modulo n: shards of the same file are disjoint,
cover it, and do not depend on where a run stopped.
"""

from __future__ import annotations

import csv
import gzip
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, cast

from bionemo_export.errors import InvalidInputError

SEQUENCE_COLUMNS = ("sequence", "seq", "smiles", "protein", "aa_seq")
ID_COLUMNS = ("id", "name", "accession", "entry")


@dataclass(frozen=True)
class Record:
    """One input sequence and what names it in messages and outputs."""

    id: str
    sequence: str
    line: int
    """Line number (1-based) where the record starts."""
    index: int = 0
    """Position in the file, 0-based, counting every record (shards keep the file's positions)."""


class ReadPosition:
    """How far into its file a reading of `iter_records` is, as a fraction of the file's bytes
    (compressed bytes for a .gz: what the reading has taken from the disk), for a job's ETA."""

    def __init__(self) -> None:
        self._handle: IO[bytes] | None = None
        self._size = 0

    def follow(self, handle: IO[bytes], size: int) -> None:
        self._handle, self._size = handle, size

    def fraction(self) -> float:
        """0.0 before the reading starts, 1.0 at the end (read-ahead makes it run a little early)."""
        if self._handle is None or self._handle.closed or self._size <= 0:
            return 0.0 if self._handle is None else 1.0
        return min(1.0, self._handle.tell() / self._size)


def iter_records(path: Path, *, shard: tuple[int, int] = (0, 1), sequence_column: str | None = None,
                 id_column: str | None = None, position: ReadPosition | None = None) -> Iterator[Record]:
    """The records of `path` one at a time (see the module's docstring for the forms); `position`,
    when given, follows how far into the file the reading is. Raises InvalidInputError naming the
    file and line for text that is not UTF-8, a CSV header without a sequence column, or a shard
    that is not 0 <= i < n."""
    index, count = parse_shard(f"{shard[0]}/{shard[1]}")
    for record in _all_records(Path(path), sequence_column, id_column, position):
        if record.index % count == index:
            yield record


def parse_shard(text: str) -> tuple[int, int]:
    """"I/N" -> (I, N), refused with the form to use unless 0 <= I < N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise InvalidInputError(f"shard {text!r}: give I/N, e.g. 0/4 for the first of 4 shards") from None
    if count < 1 or not 0 <= index < count:
        raise InvalidInputError(f"shard {text}: give I/N with 0 <= I < N (e.g. 0/4 ... 3/4)")
    return index, count


def read_records(path: Path) -> list[Record]:
    """Every record of `path` (small files: variant tables' wild types, tests)."""
    return list(iter_records(path))


def _text(raw: IO[bytes], path: Path) -> IO[str]:
    stream = gzip.GzipFile(fileobj=raw, mode="rb") if path.name.endswith(".gz") else raw
    return io.TextIOWrapper(cast(IO[bytes], stream), encoding="utf-8", newline="")


def _numbered_lines(path: Path, position: ReadPosition | None = None) -> Iterator[tuple[int, str]]:
    """(line number, line without its end), naming the file and line when it is not UTF-8 text."""
    number = 0
    try:
        with open(path, "rb") as raw, _text(raw, path) as handle:
            if position is not None:
                position.follow(raw, os.fstat(raw.fileno()).st_size)
            for number, line in enumerate(handle, 1):  # noqa: B007 (read after the loop on errors)
                yield number, line.rstrip("\r\n")
    except UnicodeDecodeError as err:
        raise InvalidInputError(f"{path}: not a UTF-8 text file ({err.reason} near line {number + 1})") from None
    except (gzip.BadGzipFile, EOFError) as err:
        raise InvalidInputError(f"{path}: not a complete gzip file ({err})") from None


def _is_data(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


def _all_records(path: Path, sequence_column: str | None, id_column: str | None,
                 position: ReadPosition | None = None) -> Iterator[Record]:
    lines = _numbered_lines(path, position)
    for number, line in lines:
        if not _is_data(line):
            continue
        first = line.strip()
        if first.startswith(">"):
            yield from _fasta(number, first, lines)
        elif _is_header(first, sequence_column):
            yield from _table(path, number, first, lines, sequence_column, id_column)
        else:
            yield from _one_per_line(number, first, lines)
        return


def _fasta(number: int, header: str, lines: Iterator[tuple[int, str]]) -> Iterator[Record]:
    index = 0
    current: tuple[str, int] = (_fasta_id(header, number), number)
    parts: list[str] = []
    for number, line in lines:
        line = line.strip()
        if line.startswith(">"):
            yield Record(current[0], "".join(parts), current[1], index)
            index += 1
            current, parts = (_fasta_id(line, number), number), []
        elif line and not line.startswith((";", "#")):  # ';': old FASTA comments
            parts.append("".join(line.split()))
    yield Record(current[0], "".join(parts), current[1], index)


def _fasta_id(header: str, number: int) -> str:
    words = header[1:].split()
    return words[0] if words else f"line{number}"


def _one_per_line(number: int, first: str, lines: Iterator[tuple[int, str]]) -> Iterator[Record]:
    def record(number: int, line: str, index: int) -> Record:
        fields = line.split()
        return Record(fields[1] if len(fields) > 1 else f"line{number}", fields[0], number, index)

    yield record(number, first, 0)
    index = 1
    for number, line in lines:
        if _is_data(line):
            yield record(number, line.strip(), index)
            index += 1


def _separator(header: str) -> str:
    return "\t" if "\t" in header else ","


def _is_header(line: str, sequence_column: str | None) -> bool:
    """A table's header: separated fields, one of them a sequence column's name."""
    separator = _separator(line)
    if separator not in line:
        return False
    names = [name.strip().lower() for name in next(csv.reader([line], delimiter=separator))]
    wanted = (sequence_column.lower(),) if sequence_column else SEQUENCE_COLUMNS
    return any(name in wanted for name in names)


def _table(path: Path, number: int, header: str, lines: Iterator[tuple[int, str]], sequence_column: str | None,
           id_column: str | None) -> Iterator[Record]:
    separator = _separator(header)
    names = [name.strip() for name in next(csv.reader([header], delimiter=separator))]
    lowered = [name.lower() for name in names]

    def column(wanted: tuple[str, ...], what: str, asked: str | None) -> int | None:
        for name in wanted:
            if name.lower() in lowered:
                return lowered.index(name.lower())
        if asked:
            raise InvalidInputError(f"{path}: line {number} names the columns {', '.join(names)}; there is no "
                                    f"{what} column {asked!r}")
        return None

    sequence_at = column((sequence_column,) if sequence_column else SEQUENCE_COLUMNS, "sequence", sequence_column)
    assert sequence_at is not None  # _is_header found one
    id_at = column((id_column,) if id_column else ID_COLUMNS, "id", id_column)
    index = 0
    for number, line in lines:
        if not line.strip():
            continue
        fields = next(csv.reader([line], delimiter=separator))
        if len(fields) <= sequence_at:
            raise InvalidInputError(f"{path}: line {number} has {len(fields)} fields; the header names "
                                    f"{len(names)} ({', '.join(names)})")
        identifier = fields[id_at].strip() if id_at is not None and id_at < len(fields) else ""
        yield Record(identifier or f"line{number}", "".join(fields[sequence_at].split()), number, index)
        index += 1
