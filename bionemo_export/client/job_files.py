"""The files of a bulk encode job (client/jobs.py): its parts, its journal, and the outputs made of them.

A part, `part-NNNNN.h5`, holds one chunk of records, in input order:

    /ids                     UTF-8 strings [n]      the record ids
    /index                   int64 [n]              each record's position in the input (0-based)
    /sequence_sha256         bytes [n] (64 hex)     SHA-256 of each sequence, for joins and duplicates
    /embeddings              float [n, H]           mean-pooled rows (an N_embeddings model, --include mean)
    /embeddings_bos          float [n, H]           the BOS/CLS token's state (--include bos)
    /embeddings_max          float [n, H]           the maximum over residues (--include max)
    /embeddings_layer20 ...  float [n, H]           a layer other than the last (--layers 20 with an
                                                    N_layers model): each pooling's name + `_layer<i>`
    /embedding               float [R, H]           per-residue states (--include per_tok), rows concatenated
    /embedding_ptr           int64 [n]              record i's rows end at embedding_ptr[i] (start: the
                                                    previous record's end, 0 for the first)
    /id, /idptr              uint8 [S], int64 [n]   the sequences' bytes concatenated, and where each ends
    /contacts                float [C]              contact maps (--include contacts): record i's [L_i, L_i]
                                                    map row-major, the records' maps concatenated
    /contacts_ptr            int64 [n]              record i's map ends at contacts_ptr[i] (start: the
                                                    previous record's end); L_i = sqrt(end - start)

The per-residue datasets are scikit-bio's `embed` format (skbio.io.format.embed, format-version
1.0: `embedding`, `embedding_ptr`, `id` holding the sequences, `idptr`, and the attributes
`format`, `format-version`, `dtype`, `dim`), so `skbio.read(path, format="embed")` yields one
ProteinEmbedding per record where a record's rows are its residues (protein models). A
single-file `.h5` output has the same layout over the whole job, and the job's metadata as
attributes of `/` (fingerprint, summary). Per-residue states are stored ragged, without padding,
so 3,000 proteins cost their residues, not 3,000 x the longest; contact maps the same way, each
record's L_i^2 values. A `.parquet` output has one row per record: `id`, `index`,
`sequence_sha256`, `embedding` (mean: a fixed-size list of H floats) and `embedding_bos` /
`embedding_max` when asked for, readable by pandas, polars or duckdb: pooled rows only (a job
refuses per-residue states and contact maps there). A directory output keeps the parts and writes
`manifest.json` listing them.

The journal, `journal.jsonl`, says what is done: a first line with the run's fingerprint, then one
line per part written (records, errors). A part exists only when its line does: parts are written
beside their final name and renamed, and a part without a line is the one a stopped run was
writing, removed and written again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
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
POOLED = {"mean": "embeddings", "bos": "embeddings_bos", "max": "embeddings_max"}
"""A pooling -> the HDF5 dataset of its rows; Parquet's column is the same name in the singular."""
_POOLED_NAME = re.compile(r"^embeddings(?P<pooling>_bos|_max)?(?:_layer(?P<layer>\d+))?$")


def pooled_dataset(key: str) -> str:
    """The HDF5 dataset of a pooled key (Chunk.pooled): `mean` -> embeddings, `bos` ->
    embeddings_bos; a layer other than the model's last, `mean@20` -> embeddings_layer20."""
    pooling, _, layer = key.partition("@")
    return POOLED[pooling] + (f"_layer{layer}" if layer else "")


def pooled_key(dataset: str) -> str | None:
    """The pooled key of an HDF5 dataset name (pooled_dataset's inverse); None for other datasets."""
    found = _POOLED_NAME.match(dataset)
    if found is None:
        return None
    pooling = {None: "mean", "_bos": "bos", "_max": "max"}[found["pooling"]]
    return pooling + (f"@{found['layer']}" if found["layer"] else "")
SKBIO_FORMAT = {"format": "embedding", "format-version": "1.0"}
"""The root attributes scikit-bio's `embed` format reads (with `dtype` and `dim`)."""


def parquet_column(pooling: str) -> str:
    """A pooled key's Parquet column: its HDF5 dataset's name in the singular (embedding_bos_layer20)."""
    return pooled_dataset(pooling).replace("embeddings", "embedding", 1)


def h5py_module() -> Any:
    try:
        import h5py
    except ImportError:  # a base install: the jobs extra brings it
        raise InvalidInputError("HDF5 outputs need h5py: pip install 'bionemo-export[jobs]'") from None
    return h5py


def file_identity(path: Path) -> dict[str, Any]:
    """What a run's fingerprint records of an input file: its size and the SHA-256 of its first MB
    (a file replaced or edited under the same name is told apart without reading it all)."""
    with path.open("rb") as handle:
        head = hashlib.sha256(handle.read(1 << 20)).hexdigest()
    return {"bytes": path.stat().st_size, "head_sha256": head}


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
    pooled: dict[str, np.ndarray] = field(default_factory=dict)
    """A pooling (mean, bos, max) -> its [n, H] rows."""
    residues: list[np.ndarray] | None = None
    """One [L_i, H] array per record, its residues' states, when the job stores them (per_tok)."""
    sequences: list[str] | None = None
    """The records' sequences, stored with per-residue states (scikit-bio's `id`)."""
    contacts: list[np.ndarray] | None = None
    """One [L_i, L_i] array per record, its contact map, when the job stores them (--include contacts)."""
    errors: list[tuple[str, int, str]] = field(default_factory=list)
    """(id, line, the server's reason) of the records left out."""

    def __len__(self) -> int:
        return len(self.ids)

    def rows(self, selected: Sequence[int]) -> Chunk:
        """The records at positions `selected`, as a chunk of their own (no errors)."""
        picked = list(selected)
        return Chunk(ids=[self.ids[i] for i in picked], index=[self.index[i] for i in picked],
                     digests=[self.digests[i] for i in picked],
                     pooled={pooling: rows[picked] for pooling, rows in self.pooled.items()},
                     residues=None if self.residues is None else [self.residues[i] for i in picked],
                     sequences=None if self.sequences is None else [self.sequences[i] for i in picked],
                     contacts=None if self.contacts is None else [self.contacts[i] for i in picked])

    @staticmethod
    def joined(chunks: Sequence[Chunk]) -> Chunk:
        """The records of `chunks` (which store the same outputs) in order, as one chunk."""
        if not chunks:
            return Chunk(ids=[], index=[], digests=[])
        first = chunks[0]
        return Chunk(ids=[i for c in chunks for i in c.ids], index=[i for c in chunks for i in c.index],
                     digests=[d for c in chunks for d in c.digests],
                     pooled={pooling: np.concatenate([c.pooled[pooling] for c in chunks]) for pooling in first.pooled},
                     residues=None if first.residues is None else [r for c in chunks for r in c.residues or []],
                     sequences=None if first.sequences is None else [s for c in chunks for s in c.sequences or []],
                     contacts=None if first.contacts is None else [m for c in chunks for m in c.contacts or []])


def part_name(number: int) -> str:
    """The file name of a job's part `number` (0-based)."""
    return f"part-{number:05d}.h5"


def write_part(path: Path, chunk: Chunk, dtype: np.dtype) -> None:
    """The chunk as an HDF5 part at `path`, written beside it and renamed (never half a part)."""
    write_hdf5([chunk], path, {}, dtype)


def read_part(path: Path) -> Chunk:
    """A part back into memory (merging, duplicates, tests)."""
    with h5py_module().File(path, "r") as handle:
        return _read_hdf5_rows(handle, 0, handle["ids"].shape[0])


def _read_hdf5_rows(handle: Any, start: int, end: int) -> Chunk:
    """Records `start` to `end` (exclusive) of an open part or .h5 output, reading those rows only."""
    chunk = Chunk(ids=[s.decode() if isinstance(s, bytes) else s for s in handle["ids"][start:end]],
                  index=handle["index"][start:end].tolist(),
                  digests=[d.decode() for d in handle["sequence_sha256"][start:end]],
                  pooled={key: handle[name][start:end] for name in handle if (key := pooled_key(name))})
    if "embedding_ptr" in handle:
        chunk.residues = _ragged(handle["embedding"], handle["embedding_ptr"], start, end)
        chunk.sequences = [row.tobytes().decode() for row in _ragged(handle["id"], handle["idptr"], start, end)]
    if "contacts_ptr" in handle:
        chunk.contacts = [_square(values, handle.filename)
                          for values in _ragged(handle["contacts"], handle["contacts_ptr"], start, end)]
    return chunk


def _ragged(values: Any, ends: Any, start: int, end: int) -> list[np.ndarray]:
    """Records `start` to `end` of a ragged dataset whose record i ends at `ends[i]` (scikit-bio's pointers)."""
    if end <= start:
        return []
    bounds = np.concatenate([[int(ends[start - 1]) if start else 0], ends[start:end]]).astype(np.int64)
    block = values[bounds[0]:bounds[-1]]
    bounds -= bounds[0]
    return [block[bounds[i]:bounds[i + 1]] for i in range(end - start)]


def _square(values: np.ndarray, file: str) -> np.ndarray:
    """A contact map's L^2 stored values (row-major) in `file` as its [L, L] array."""
    side = math.isqrt(len(values))
    if side * side != len(values):
        raise InvalidInputError(f"{file}: a stored contact map holds {len(values)} values, not L x L (contacts_ptr "
                                "does not match contacts): the file is damaged; run the job again into a new output")
    return values.reshape(side, side)


def read_digests(path: Path) -> list[str]:
    """A part's sequence digests only (a resumed run's index of what it has answered)."""
    with h5py_module().File(path, "r") as handle:
        return [d.decode() for d in handle["sequence_sha256"][()]]


def read_rows(path: Path, rows: Sequence[int]) -> dict[int, Chunk]:
    """row -> that record of a part, as a chunk of one, reading those rows only."""
    with h5py_module().File(path, "r") as handle:
        return {row: _read_hdf5_rows(handle, row, row + 1) for row in rows}


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


def work_folder(output: Path) -> Path:
    """Where a job keeps its parts and journal: a directory output itself, `<output>.parts/` beside a file."""
    return output if not output.suffix else output.with_name(output.name + ".parts")


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
                yield _read_hdf5_rows(handle, start, min(start + rows, total))
    else:
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=rows):
            pooled = {}
            for name in batch.schema.names:
                key = pooled_key(name.replace("embedding", "embeddings", 1)) if name.startswith("embedding") else None
                if key is not None:
                    column = batch.column(name)
                    pooled[key] = column.flatten().to_numpy(zero_copy_only=False).reshape(-1, column.type.list_size)
            yield Chunk(ids=batch.column("id").to_pylist(), index=batch.column("index").to_pylist(),
                        digests=batch.column("sequence_sha256").to_pylist(), pooled=pooled)


class Journal:
    """journal.jsonl: the fingerprint line, then one line per finished part (flushed to disk); also
    the journal of a resumable `client score` (variants.py), one line per chunk written."""

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
        self.add({"part": part, "records": records, "residues": residues, "errors": [list(e) for e in errors]})

    def add(self, entry: dict[str, Any]) -> None:
        """One more finished step, on disk (fsynced) before this returns."""
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
        residue_rows = sequence_bytes = contact_values = 0  # where the ragged datasets' pointers stand
        for chunk in chunks:
            give_back_memory()  # the previous chunk's arrays
            if not len(chunk):
                continue
            columns: dict[str, np.ndarray] = {
                "ids": np.asarray(chunk.ids, dtype=object), "index": np.asarray(chunk.index, dtype=np.int64),
                "sequence_sha256": np.asarray(chunk.digests, dtype="S64")}
            for pooling, rows in chunk.pooled.items():
                columns[pooled_dataset(pooling)] = rows.astype(dtype, copy=False)
            if chunk.residues is not None:
                if chunk.sequences is None:
                    raise ValueError("per-residue states are stored with their sequences (scikit-bio's `id`)")
                encoded = [sequence.encode() for sequence in chunk.sequences]
                columns["embedding"] = np.concatenate(chunk.residues).astype(dtype, copy=False)
                columns["embedding_ptr"] = residue_rows + np.cumsum([len(r) for r in chunk.residues], dtype=np.int64)
                columns["id"] = np.frombuffer(b"".join(encoded), dtype=np.uint8)
                columns["idptr"] = sequence_bytes + np.cumsum([len(e) for e in encoded], dtype=np.int64)
                residue_rows, sequence_bytes = int(columns["embedding_ptr"][-1]), int(columns["idptr"][-1])
                if "format" not in handle.attrs:
                    handle.attrs.update({**SKBIO_FORMAT, "dtype": np.dtype(dtype).name,
                                         "dim": int(columns["embedding"].shape[1])})
            if chunk.contacts is not None:
                columns["contacts"] = np.concatenate([m.reshape(-1) for m in chunk.contacts]).astype(dtype, copy=False)
                columns["contacts_ptr"] = contact_values + np.cumsum([m.size for m in chunk.contacts], dtype=np.int64)
                contact_values = int(columns["contacts_ptr"][-1])
            for name, column in columns.items():
                if name not in datasets:
                    kind = h5py.string_dtype() if name == "ids" else column.dtype
                    datasets[name] = handle.create_dataset(name, shape=(0, *column.shape[1:]), dtype=kind,
                                                           maxshape=(None, *column.shape[1:]),
                                                           chunks=_chunk_shape(column))
                _append(datasets[name], column)
        if not datasets:  # no record: an empty output still says what it is
            handle.create_dataset("ids", shape=(0,), dtype=h5py.string_dtype())
            handle.create_dataset("index", shape=(0,), dtype=np.int64)
            handle.create_dataset("sequence_sha256", shape=(0,), dtype="S64")
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
            if not len(chunk):
                continue
            if not chunk.pooled:
                raise InvalidInputError(f"{out}: Parquet holds pooled rows; per-residue states and contact maps go to "
                                        "an .h5 output or a directory")
            columns = {"id": pa.array(chunk.ids, pa.string()), "index": pa.array(chunk.index, pa.int64()),
                       "sequence_sha256": pa.array(chunk.digests, pa.string())}
            for pooling, rows in chunk.pooled.items():
                values = pa.array(rows.astype(dtype).reshape(-1))
                columns[parquet_column(pooling)] = pa.FixedSizeListArray.from_arrays(values, rows.shape[1])
            table = pa.table(columns)
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
