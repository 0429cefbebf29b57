"""The files of a bulk encode job (client/jobs.py): its parts, its journal, and the outputs made of them.

A part, `part-NNNNN.h5`, holds one chunk of records, in input order:

    /ids                     UTF-8 strings [n]        the record ids
    /index                   int64 [n]                each record's position in the input (0-based)
    /sequence_sha256         bytes [n] (64 hex)       SHA-256 of each sequence, for joins and duplicates
    /embeddings              float [n, H]             pooled outputs (an N_embeddings model)
    /per_residue/values      float [R, H]             per-residue outputs (N_hiddens), rows concatenated
    /per_residue/offsets     int64 [n + 1]            record i's rows are values[offsets[i]:offsets[i+1]]

A single-file `.h5` output has the same layout over the whole job, and the job's metadata as
attributes of `/` (model, repository, precision, fingerprint, summary). Per-residue states are
stored ragged, without padding, so 3,000 proteins cost their residues, not 3,000 x the longest.
A `.parquet` output has one row per record: `id`, `index`, `sequence_sha256`, `embedding`
(fixed-size list of H floats), readable by pandas, polars or duckdb. A directory output keeps the
parts and writes `manifest.json` listing them.

The journal, `journal.jsonl`, says what is done: a first line with the run's fingerprint, then one
line per part written (records, errors). A part exists only when its line does: parts are written
beside their final name and renamed, and a part without a line is the one a stopped run was
writing, removed and written again.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bionemo_export.errors import InvalidInputError

from .memory import give_back_memory

JOURNAL = "journal.jsonl"
SEEN_INDEX = "seen.sqlite"
"""The job's index of the sequences it has answered (SeenSequences); removed when the job finishes."""
MANIFEST = "manifest.json"
FORMATS = {".h5": "hdf5", ".hdf5": "hdf5", ".parquet": "parquet"}
STRINGS = {"vlen": str}


def h5py_module() -> Any:
    try:
        import h5py
    except ImportError:  # a base install: the jobs extra brings it
        raise InvalidInputError("HDF5 outputs need h5py: pip install 'bionemo-export[jobs]'") from None
    return h5py


def sequence_digest(sequence: str) -> str:
    return hashlib.sha256(sequence.encode("utf-8")).hexdigest()


class SeenSequences:
    """Sequence digest -> (part number, row) of the sequence's first answer in a job: how a job
    finds its duplicates without holding them. An SQLite file in the job's folder (its page cache
    4 MB), so that the client's memory is the same at ten thousand records and a million; an
    in-memory dict of hex digests took 290 bytes a sequence (measured), sorted arrays 16.

    Keys are the digest's first 64 bits: two sequences may share one (about once in 10^7 jobs of
    a million sequences), so a hit is a candidate that the caller confirms against the full digest
    stored in the part (EncodeJob does), never an answer by itself. `parts` says how many of the
    job's parts are indexed: after a stop, the parts the journal does not record are forgotten,
    and those it records but the index lacks (a folder copied from object storage) are added.
    """

    def __init__(self, path: Path) -> None:
        self.connection = sqlite3.connect(path, isolation_level=None)
        self.connection.execute("PRAGMA cache_size = -4096")  # KiB
        self.connection.execute("PRAGMA journal_mode = WAL")
        self.connection.execute("PRAGMA synchronous = NORMAL")  # the index can be rebuilt from the parts
        self.connection.execute("CREATE TABLE IF NOT EXISTS seen (key INTEGER PRIMARY KEY, part INTEGER, row INTEGER)"
                                " WITHOUT ROWID")

    @staticmethod
    def key(digest: str) -> int:
        return int.from_bytes(bytes.fromhex(digest[:16]), "big", signed=True)  # SQLite integers are signed

    @property
    def parts(self) -> int:
        """Parts indexed: 1 + the highest part number in the index (0 when empty)."""
        (highest,) = self.connection.execute("SELECT MAX(part) FROM seen").fetchone()
        return 0 if highest is None else highest + 1

    def forget_parts_from(self, part: int) -> None:
        """Drop what parts `part` and later added (a stopped run's, which the journal does not record)."""
        self.connection.execute("DELETE FROM seen WHERE part >= ?", (part,))

    def find(self, digests: Iterable[str]) -> dict[str, tuple[int, int]]:
        """digest -> (part number, row) of the first sequence with its key, for those indexed."""
        wanted: dict[int, list[str]] = {}
        for digest in digests:
            wanted.setdefault(self.key(digest), []).append(digest)
        found: dict[str, tuple[int, int]] = {}
        keys = list(wanted)
        for start in range(0, len(keys), 500):  # under SQLite's limit of bound values a statement
            batch = keys[start:start + 500]
            query = f"SELECT key, part, row FROM seen WHERE key IN ({','.join('?' * len(batch))})"
            for key, part, row in self.connection.execute(query, batch):
                for digest in wanted[key]:
                    found[digest] = (part, row)
        return found

    def add(self, part: int, digests: Sequence[str]) -> None:
        """Part `part`'s rows: where each digest's key is new, its first answer is there."""
        self.connection.execute("BEGIN")
        self.connection.executemany("INSERT OR IGNORE INTO seen VALUES (?, ?, ?)",
                                    [(self.key(digest), part, row) for row, digest in enumerate(digests)])
        self.connection.execute("COMMIT")

    def __len__(self) -> int:
        return self.connection.execute("SELECT COUNT(*) FROM seen").fetchone()[0]

    def close(self) -> None:
        self.connection.close()


@dataclass
class Chunk:
    """One chunk's answers, in input order: what a part holds."""

    ids: list[str]
    index: list[int]
    digests: list[str]
    embeddings: np.ndarray | None = None
    """[n, H] pooled outputs, when the model answers `embeddings`."""
    residues: list[np.ndarray] | None = None
    """One [L_i, H] array per record, when the model answers `hiddens` and `mask`."""
    errors: list[tuple[str, int, str]] = field(default_factory=list)
    """(id, line, the server's reason) of the records left out."""

    def __len__(self) -> int:
        return len(self.ids)


def part_name(number: int) -> str:
    """The file name of a job's part `number` (0-based)."""
    return f"part-{number:05d}.h5"


def write_part(path: Path, chunk: Chunk, dtype: np.dtype) -> None:
    """The chunk as an HDF5 part at `path`, written beside it and renamed (never half a part)."""
    h5py = h5py_module()
    staging = path.with_name(path.name + ".writing")
    with h5py.File(staging, "w") as handle:
        handle.create_dataset("ids", data=chunk.ids, dtype=h5py.string_dtype())
        handle.create_dataset("index", data=np.asarray(chunk.index, dtype=np.int64))
        handle.create_dataset("sequence_sha256", data=np.asarray(chunk.digests, dtype="S64"))
        if chunk.embeddings is not None:
            handle.create_dataset("embeddings", data=chunk.embeddings.astype(dtype, copy=False))
        if chunk.residues is not None:
            offsets = np.concatenate([[0], np.cumsum([len(r) for r in chunk.residues])]).astype(np.int64)
            width = chunk.residues[0].shape[-1] if chunk.residues else 0
            values = np.concatenate(chunk.residues) if chunk.residues else np.zeros((0, width))
            group = handle.create_group("per_residue")
            group.create_dataset("values", data=values.astype(dtype, copy=False))
            group.create_dataset("offsets", data=offsets)
    os.replace(staging, path)


def read_part(path: Path) -> Chunk:
    """A part back into memory (merging, duplicates, tests)."""
    h5py = h5py_module()
    with h5py.File(path, "r") as handle:
        chunk = Chunk(ids=[s.decode() if isinstance(s, bytes) else s for s in handle["ids"][()]],
                      index=handle["index"][()].tolist(),
                      digests=[d.decode() for d in handle["sequence_sha256"][()]])
        if "embeddings" in handle:
            chunk.embeddings = handle["embeddings"][()]
        if "per_residue" in handle:
            values, offsets = handle["per_residue/values"][()], handle["per_residue/offsets"][()]
            chunk.residues = [values[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    return chunk


def read_digests(path: Path) -> list[str]:
    """A part's sequence digests only (a resumed run's index of what it has answered)."""
    with h5py_module().File(path, "r") as handle:
        return [d.decode() for d in handle["sequence_sha256"][()]]


def read_rows(path: Path, rows: Sequence[int]) -> dict[int, tuple[str, np.ndarray | None, np.ndarray | None]]:
    """row -> (sequence digest, pooled [H] or None, per-residue [L, H] or None) for `rows` of a
    part, reading those rows only."""
    found = {}
    with h5py_module().File(path, "r") as handle:
        offsets = handle["per_residue/offsets"] if "per_residue" in handle else None
        for row in rows:
            pooled = handle["embeddings"][row] if "embeddings" in handle else None
            residues = None
            if offsets is not None:
                start, end = int(offsets[row]), int(offsets[row + 1])
                residues = handle["per_residue/values"][start:end]
            found[row] = (handle["sequence_sha256"][row].decode(), pooled, residues)
    return found


def read_metadata(path: Path) -> dict[str, Any] | None:
    """The metadata a finished output holds (fingerprint, summary), or None when there is no output."""
    if not path.is_file():
        return None
    try:
        if path.name == MANIFEST:
            return json.loads(path.read_text())
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return json.loads(pq.read_schema(path).metadata[b"bionemo_export"])
        with h5py_module().File(path, "r") as handle:
            return {name: json.loads(handle.attrs[name]) for name in ("fingerprint", "summary")}
    except (OSError, KeyError, ValueError, TypeError) as err:
        raise InvalidInputError(f"{path} exists and is not a finished job's output ({err}); remove it or give "
                                "another name") from None


def metadata_file(output: Path) -> Path:
    """Where a finished output keeps its metadata: a directory's manifest.json, else the file itself."""
    return output / MANIFEST if not output.suffix else output


def errors_file(output: Path) -> Path:
    """Where a job lists the records the server refused: errors.tsv in a directory, else beside the file."""
    return output / "errors.tsv" if not output.suffix else output.with_name(output.name + ".errors.tsv")


def write_manifest(directory: Path, metadata: dict[str, Any], parts: Sequence[tuple[str, int]]) -> None:
    """A directory output's manifest.json: the metadata and its parts in order, (file, records) each;
    written beside its name and renamed, so a manifest is there only for a finished output."""
    manifest = {**metadata, "parts": [{"file": name, "records": records} for name, records in parts]}
    staging = directory / (MANIFEST + ".writing")
    staging.write_text(json.dumps(manifest, indent=1) + "\n")
    staging.replace(directory / MANIFEST)


def output_chunks(path: Path, rows: int = 1024) -> Iterator[Chunk]:
    """A finished job's output (a directory of parts, an .h5 or a .parquet file) as chunks of at
    most `rows` records, in its order, one chunk in memory at a time."""
    if path.is_dir():
        manifest = json.loads((path / MANIFEST).read_text())
        for part in manifest["parts"]:
            yield read_part(path / part["file"])
    elif FORMATS.get(path.suffix) == "hdf5":
        with h5py_module().File(path, "r") as handle:
            total = handle["ids"].shape[0]
            for start in range(0, total, rows):
                end = min(start + rows, total)
                chunk = Chunk(ids=[s.decode() if isinstance(s, bytes) else s for s in handle["ids"][start:end]],
                              index=handle["index"][start:end].tolist(),
                              digests=[d.decode() for d in handle["sequence_sha256"][start:end]])
                if "embeddings" in handle:
                    chunk.embeddings = handle["embeddings"][start:end]
                if "per_residue" in handle:
                    offsets = handle["per_residue/offsets"][start:end + 1]
                    values = handle["per_residue/values"][offsets[0]:offsets[-1]]
                    chunk.residues = [values[offsets[i] - offsets[0]:offsets[i + 1] - offsets[0]]
                                      for i in range(end - start)]
                yield chunk
    else:
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=rows):
            embedding = batch.column("embedding")
            yield Chunk(ids=batch.column("id").to_pylist(), index=batch.column("index").to_pylist(),
                        digests=batch.column("sequence_sha256").to_pylist(),
                        embeddings=embedding.flatten().to_numpy(zero_copy_only=False).reshape(
                            -1, embedding.type.list_size))


class Journal:
    """journal.jsonl: the fingerprint line, then one line per finished part (flushed to disk)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fingerprint: dict[str, Any] | None = None
        self.parts: list[dict[str, Any]] = []
        if path.is_file():
            text = path.read_text()
            if text and not text.endswith("\n"):  # a run killed while writing its last line: drop that line
                text = text[:text.rfind("\n") + 1]
                with path.open("r+") as handle:
                    handle.truncate(len(text.encode()))
            lines = [json.loads(line) for line in text.splitlines() if _complete(line)]
            if lines:
                self.fingerprint, self.parts = lines[0]["fingerprint"], lines[1:]

    def start(self, fingerprint: dict[str, Any]) -> None:
        """A new journal, or the check that this one is the same run's."""
        if self.fingerprint is None:
            self.fingerprint = fingerprint
            self._append({"fingerprint": fingerprint})
            return
        differing = sorted(key for key in fingerprint.keys() | self.fingerprint.keys()
                           if fingerprint.get(key) != self.fingerprint.get(key))
        if differing:
            raise InvalidInputError(
                f"{self.path} is the journal of another run (its {', '.join(differing)} differ: "
                + "; ".join(f"{k} was {self.fingerprint.get(k)!r}, now {fingerprint.get(k)!r}" for k in differing)
                + "): rerun that run's command to finish it, or give another --output")

    def finished(self, part: str, records: int, residues: int, errors: list[tuple[str, int, str]]) -> None:
        entry = {"part": part, "records": records, "residues": residues, "errors": [list(e) for e in errors]}
        self._append(entry)
        self.parts.append(entry)

    @property
    def records_done(self) -> int:
        """Records of the input (after sharding) the finished parts cover, answered or not."""
        return sum(entry["records"] + len(entry["errors"]) for entry in self.parts)

    def _append(self, entry: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(entry) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


def _complete(line: str) -> bool:
    """A line the run finished writing (a killed run may leave half a last line)."""
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def write_hdf5(chunks: Iterable[Chunk], out: Path, attributes: dict[str, Any], dtype: np.dtype) -> None:
    """`chunks` as one HDF5 file at `out` (written beside it and renamed), one chunk in memory at a time."""
    h5py = h5py_module()
    staging = out.with_name(out.name + ".writing")
    # No chunk cache: rows are appended in order, each chunk written once it is reached; HDF5's
    # cache (1 MB a dataset, in practice more) only grew the merging process.
    with h5py.File(staging, "w", rdcc_nbytes=0) as handle:
        for name, value in attributes.items():
            handle.attrs[name] = value if isinstance(value, str | int | float) else json.dumps(value)
        datasets: dict[str, Any] = {}
        residues = 0
        for chunk in chunks:
            give_back_memory()  # the previous chunk's arrays
            columns: dict[str, np.ndarray] = {
                "ids": np.asarray(chunk.ids, dtype=object), "index": np.asarray(chunk.index, dtype=np.int64),
                "sequence_sha256": np.asarray(chunk.digests, dtype="S64")}
            if chunk.embeddings is not None:
                columns["embeddings"] = chunk.embeddings.astype(dtype, copy=False)
            if chunk.residues is not None:
                lengths = np.asarray([len(r) for r in chunk.residues], dtype=np.int64)
                columns["per_residue/offsets"] = residues + np.cumsum(lengths)
                width = chunk.residues[0].shape[-1] if chunk.residues else 0
                columns["per_residue/values"] = (np.concatenate(chunk.residues) if chunk.residues
                                                 else np.zeros((0, width), dtype=dtype)).astype(dtype, copy=False)
                residues += int(lengths.sum())
            for name, column in columns.items():
                if name not in datasets:
                    kind = h5py.string_dtype() if name == "ids" else column.dtype
                    datasets[name] = handle.create_dataset(name, shape=(0, *column.shape[1:]), dtype=kind,
                                                           maxshape=(None, *column.shape[1:]),
                                                           chunks=_chunk_shape(column))
                    if name == "per_residue/offsets":
                        datasets[name].resize((1,))
                        datasets[name][0] = 0
                _append(datasets[name], column)
        if not datasets:  # no part: an empty job still says what it is
            handle.create_dataset("ids", shape=(0,), dtype=h5py.string_dtype())
    os.replace(staging, out)


def _chunk_shape(column: np.ndarray) -> tuple[int, ...]:
    """HDF5 chunks of about 1 MB along the rows: h5py's own guess for a dataset that starts empty is
    a few KB, and HDF5 keeps an index entry of every chunk in its metadata cache, which grew the
    merging process by 28 MB over 200 parts (measured) before it stopped at the cache's limit."""
    row_bytes = max(1, int(np.prod(column.shape[1:], dtype=np.int64)) * column.dtype.itemsize)
    if column.dtype == object:  # variable-length strings: the chunk holds references, 16 bytes each
        row_bytes = 16
    return (max(1024, (1 << 20) // row_bytes), *column.shape[1:])


def _append(dataset: Any, column: np.ndarray) -> None:
    start = dataset.shape[0]
    dataset.resize((start + len(column), *dataset.shape[1:]))
    if len(column):
        dataset[start:] = column


def write_parquet(chunks: Iterable[Chunk], out: Path, metadata: dict[str, Any], dtype: np.dtype) -> None:
    """Pooled rows as Parquet at `out` (written beside it and renamed), one chunk in memory at a time."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise InvalidInputError("Parquet outputs need pyarrow: pip install 'bionemo-export[jobs]'") from None
    staging = out.with_name(out.name + ".writing")
    writer = None
    try:
        for chunk in chunks:
            if chunk.embeddings is None:
                raise InvalidInputError(f"{out}: Parquet holds pooled rows; per-residue states go to an .h5 output "
                                        "or a directory")
            values = pa.array(chunk.embeddings.astype(dtype).reshape(-1))
            table = pa.table({"id": pa.array(chunk.ids, pa.string()), "index": pa.array(chunk.index, pa.int64()),
                              "sequence_sha256": pa.array(chunk.digests, pa.string()),
                              "embedding": pa.FixedSizeListArray.from_arrays(values, chunk.embeddings.shape[1])})
            if writer is None:
                schema = table.schema.with_metadata({"bionemo_export": json.dumps(metadata)})
                writer = pq.ParquetWriter(staging, schema)
            writer.write_table(table.replace_schema_metadata(writer.schema.metadata))
    finally:
        if writer is not None:
            writer.close()
    if writer is None:
        raise InvalidInputError(f"{out}: no record was answered; nothing to write")
    os.replace(staging, out)
