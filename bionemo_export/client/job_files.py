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
line per part written (records, errors, the part's size and SHA-256). A part exists only when its
line does: parts are written beside their final name, fsynced, renamed and their folder fsynced
(`durable_replace`), and a part without a line is the one a stopped run was writing, removed and
written again. A resume checks every recorded part against its size and digest (`part_problem`)
and writes again from the first that does not match (a crash, a reboot, a damaged disk).

Names read back from a journal or a manifest are data: each must be a plain part name
(`part-NNNNN.h5`) inside the folder (`plain_part_name`), never a path.
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

from bionemo_export.digests import file_digest
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
_PART_NAME = re.compile(r"part-\d{5,}\.h5")


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


def plain_part_name(name: object, source: Path | str) -> str:
    """A part's name read from a journal or a manifest (`source`), which must be a plain part name
    inside its folder (part-NNNNN.h5): a damaged or hostile one (`../../x`, `/etc/passwd`) is
    refused naming the file it was read from, before anything is read or written under it."""
    if not isinstance(name, str) or not _PART_NAME.fullmatch(name):
        raise InvalidInputError(f"{source} names the part {name!r}, which is not a part file in its folder "
                                "(part-NNNNN.h5): the file is damaged or was not written by this tool; remove it, or "
                                "run the job into a new output")
    return name


def durable_replace(staging: Path, final: Path) -> None:
    """`staging` (written and closed) renamed to `final` so that a crash or a power cut leaves the old
    file or the whole new one, never a name that points at unwritten blocks: the file's data is
    fsynced before the rename, and the folder's entry after it."""
    _fsync(staging)
    os.replace(staging, final)
    fsync_folder(final.parent)


def fsync_folder(folder: Path) -> None:
    """The folder's entries (a rename, a new file) on disk."""
    _fsync(folder, os.O_DIRECTORY)


def _fsync(path: Path, flags: int = 0) -> None:
    """What was written to the file at `path` (a folder, with O_DIRECTORY) on disk."""
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def part_record(path: Path) -> dict[str, Any]:
    """What the journal records of a part written at `path`: {"bytes", "sha256"}, read from the file."""
    return file_digest(path)


def part_problem(path: Path, entry: dict[str, Any]) -> str | None:
    """Why the part at `path` is not what the journal `entry` recorded (missing, another size or
    SHA-256), or None when it is. An entry of an earlier version without size or digest: the part
    must open as HDF5 and hold the recorded number of records."""
    if not path.is_file():
        return "it is missing"
    if "sha256" in entry:
        size = path.stat().st_size
        if size != entry.get("bytes"):
            return f"it holds {size} bytes, the journal recorded {entry.get('bytes')}"
        found = file_digest(path)["sha256"]
        return None if found == entry["sha256"] else f"its SHA-256 is {found[:16]}..., not the recorded one"
    try:
        with h5py_module().File(path, "r") as handle:
            rows = handle["ids"].shape[0]
    except (OSError, KeyError) as err:
        return f"it does not open as a part ({err})"
    return None if rows == entry.get("records") else f"it holds {rows} records, the journal recorded {entry['records']}"


def write_part(path: Path, chunk: Chunk, dtype: np.dtype) -> None:
    """The chunk as an HDF5 part at `path`, written beside it and put in place durably (never half a part)."""
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
    durable_replace(staging, directory / MANIFEST)


RAGGED_VALUES_READ = 8 << 20
"""Per-residue or contact values read back at once at most (32 MB as fp32), whatever `rows` says:
a part of 1,024 proteins of 1,000 residues at width 1,280 holds 1.3G values."""


def hdf5_chunks(path: Path, rows: int = 1024, values: int = RAGGED_VALUES_READ) -> Iterator[Chunk]:
    """A part or an .h5 output as chunks of at most `rows` records and `values` ragged values (a
    record larger than that comes alone), one chunk in memory at a time."""
    with h5py_module().File(path, "r") as handle:
        total = handle["ids"].shape[0]
        sizes = None  # ragged values up to the end of each record (the pointers are n int64s: small)
        if "embedding_ptr" in handle:
            sizes = handle["embedding_ptr"][()] * int(np.prod(handle["embedding"].shape[1:]))
        if "contacts_ptr" in handle:
            sizes = handle["contacts_ptr"][()] + (0 if sizes is None else sizes)
        start = 0
        while start < total:
            end = min(start + rows, total)
            if sizes is not None:
                before = int(sizes[start - 1]) if start else 0
                fits = int(np.searchsorted(sizes, before + values, side="right"))
                end = max(start + 1, min(end, fits))
            yield _read_hdf5_rows(handle, start, end)
            start = end


def output_chunks(path: Path, rows: int = 1024) -> Iterator[Chunk]:
    """A finished job's output (a directory of parts, an .h5 or a .parquet file) as chunks of at
    most `rows` records, in its order, one chunk in memory at a time."""
    if path.is_dir():
        manifest = json.loads((path / MANIFEST).read_text())
        for part in manifest["parts"]:
            yield from hdf5_chunks(path / plain_part_name(part.get("file"), path / MANIFEST), rows)
    elif FORMATS.get(path.suffix) == "hdf5":
        yield from hdf5_chunks(path, rows)
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
    """journal.jsonl: the fingerprint line, then one line per finished part (fsynced); also the
    journal of a resumable `client score` (variants.py), one line per chunk written.

    Part names are checked as they are read (plain_part_name). A part's errors stay in the file:
    in memory an entry holds their count (`error_count`), and `errors()` reads them back a part
    at a time, so that a job with millions of bad records does not hold them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fingerprint: dict[str, Any] | None = None
        self.parts: list[dict[str, Any]] = []
        self.notes: dict[str, Any] = {}
        """What a run learned as it went and a later run checks (the whole input's digest), in the first line."""
        if not path.is_file():
            return
        with path.open("r+b") as handle:  # a run killed while writing its last line: drop that line
            size = handle.seek(0, os.SEEK_END)
            if size:
                handle.seek(max(0, size - 1))
                if handle.read(1) != b"\n":
                    handle.seek(0)
                    text = handle.read()
                    handle.truncate(text.rfind(b"\n") + 1)
        for number, entry in enumerate(self._lines()):
            if number == 0:
                self.fingerprint, self.notes = entry["fingerprint"], entry.get("notes", {})
                continue
            if "part" in entry:
                plain_part_name(entry["part"], path)
            self.parts.append(_counted(entry))

    def start(self, fingerprint: dict[str, Any]) -> None:
        """A new journal, or the check that this one is the same run's."""
        if self.fingerprint is None:
            self.fingerprint = fingerprint
            self._rewrite()
            return
        differing = sorted(key for key in fingerprint.keys() | self.fingerprint.keys()
                           if fingerprint.get(key) != self.fingerprint.get(key))
        if differing:
            raise InvalidInputError(
                f"{self.path} is the journal of another run (its {', '.join(differing)} differ: "
                + "; ".join(f"{k} was {self.fingerprint.get(k)!r}, now {fingerprint.get(k)!r}" for k in differing)
                + "): rerun that run's command to finish it, or give another --output")

    def finished(self, part: Path, records: int, residues: int, errors: list[tuple[str, int, str]]) -> None:
        """The part written at `part` (durably, under its final name), with its size and SHA-256."""
        self.add({"part": part.name, "records": records, "residues": residues, "errors": [list(e) for e in errors],
                  **part_record(part)})

    def add(self, entry: dict[str, Any]) -> None:
        """One more finished step, on disk (fsynced) before this returns."""
        self._append(entry)
        self.parts.append(_counted(entry))

    def keep(self, count: int) -> None:
        """Keep the first `count` steps only (those after are done again), on disk before this returns."""
        del self.parts[count:]
        self._rewrite()

    def note(self, key: str, value: Any) -> None:
        """Record `value` under `key` in the first line's notes, on disk before this returns."""
        self.notes[key] = value
        self._rewrite()

    def errors(self) -> Iterator[list[list[Any]]]:
        """Each recorded part's errors ([id, line, reason] each), in order, read from the file."""
        for number, entry in enumerate(self._lines()):
            if 0 < number <= len(self.parts):
                yield entry.get("errors", [])

    @property
    def records_done(self) -> int:
        """Records of the input (after sharding) the finished parts cover, answered or not."""
        return sum(entry["records"] + entry["error_count"] for entry in self.parts)

    def _lines(self) -> Iterator[dict[str, Any]]:
        """The file's complete lines, parsed, one at a time."""
        if not self.path.is_file():
            return
        with self.path.open() as handle:
            for line in handle:
                if _complete(line):
                    yield json.loads(line)

    def _rewrite(self) -> None:
        """The journal written beside itself and put in place durably (a new journal, new notes, a
        shortened one): the first line anew, then the kept steps' lines as they are."""
        first: dict[str, Any] = {"fingerprint": self.fingerprint}
        if self.notes:
            first["notes"] = self.notes
        staging = self.path.with_name(self.path.name + ".writing")
        with staging.open("w") as written:
            written.write(json.dumps(first) + "\n")
            for number, entry in enumerate(self._lines()):
                if 0 < number <= len(self.parts):
                    written.write(json.dumps(entry) + "\n")
        durable_replace(staging, self.path)

    def _append(self, entry: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(entry) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


def _counted(entry: dict[str, Any]) -> dict[str, Any]:
    """A journal entry as held in memory: its errors replaced by their count (`error_count`)."""
    held = {key: value for key, value in entry.items() if key != "errors"}
    held["error_count"] = len(entry.get("errors", []))
    return held


def _complete(line: str) -> bool:
    """A line the run finished writing (a killed run may leave half a last line)."""
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def write_hdf5(chunks: Iterable[Chunk], out: Path, attributes: dict[str, Any], dtype: np.dtype) -> None:
    """`chunks` as one HDF5 file at `out` (written beside it and put in place durably), one chunk in
    memory at a time."""
    with Hdf5Writer(out, attributes, dtype, buffer_bytes=0) as writer:
        for chunk in chunks:
            give_back_memory()  # the previous chunk's arrays
            writer.add(chunk)


class Hdf5Writer:
    """An HDF5 part or output written as its records arrive (the layout of the module's docstring):
    records are appended in order, a few MB at a time (`buffer_bytes`: small answers are gathered
    so that each append is worth its cost), into `<out>.writing`, which `close` puts in place
    durably. Leaving the context on an error removes the unfinished file.

        with Hdf5Writer(tmp / "part-00000.h5", {}, np.dtype(np.float16)) as part:
            for answer in answers:
                part.add(answer)        # a chunk of a few records, arrays already in `dtype`
    """

    def __init__(self, out: Path, attributes: dict[str, Any], dtype: np.dtype, buffer_bytes: int = 8 << 20) -> None:
        h5py = h5py_module()
        self.out, self.dtype, self.buffer_bytes = out, np.dtype(dtype), buffer_bytes
        self.staging = out.with_name(out.name + ".writing")
        # No chunk cache: rows are appended in order, each chunk written once it is reached; HDF5's
        # cache (1 MB a dataset, in practice more) only grew the merging process.
        self.handle = h5py.File(self.staging, "w", rdcc_nbytes=0)
        for name, value in attributes.items():
            self.handle.attrs[name] = value if isinstance(value, str | int | float) else json.dumps(value)
        self.datasets: dict[str, Any] = {}
        self.records = 0
        self._ends = {"embedding": 0, "id": 0, "contacts": 0}  # where the ragged datasets' pointers stand
        self._buffer: list[Chunk] = []
        self._buffered = 0

    def add(self, chunk: Chunk) -> None:
        """`chunk`'s records after those added before."""
        if not len(chunk):
            return
        self.records += len(chunk)
        self._buffer.append(chunk)
        self._buffered += _nbytes(chunk)
        if self._buffered >= self.buffer_bytes:
            self.flush()

    def flush(self) -> None:
        """The records added so far into the file."""
        if self._buffer:
            chunk = self._buffer[0] if len(self._buffer) == 1 else Chunk.joined(self._buffer)
            self._buffer, self._buffered = [], 0
            self._write(chunk)

    def close(self) -> None:
        """The file complete, under its name."""
        self.flush()
        if not self.datasets:  # no record: an empty output still says what it is
            h5py = h5py_module()
            self.handle.create_dataset("ids", shape=(0,), dtype=h5py.string_dtype())
            self.handle.create_dataset("index", shape=(0,), dtype=np.int64)
            self.handle.create_dataset("sequence_sha256", shape=(0,), dtype="S64")
        self.handle.close()
        durable_replace(self.staging, self.out)

    def __enter__(self) -> Hdf5Writer:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is None:
            self.close()
        else:
            self.handle.close()
            self.staging.unlink(missing_ok=True)

    def _write(self, chunk: Chunk) -> None:
        dtype, handle = self.dtype, self.handle
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
            columns["embedding_ptr"] = self._pointers("embedding", [len(r) for r in chunk.residues])
            columns["id"] = np.frombuffer(b"".join(encoded), dtype=np.uint8)
            columns["idptr"] = self._pointers("id", [len(e) for e in encoded])
            if "format" not in handle.attrs:
                handle.attrs.update({**SKBIO_FORMAT, "dtype": dtype.name, "dim": int(columns["embedding"].shape[1])})
        if chunk.contacts is not None:
            columns["contacts"] = np.concatenate([m.reshape(-1) for m in chunk.contacts]).astype(dtype, copy=False)
            columns["contacts_ptr"] = self._pointers("contacts", [m.size for m in chunk.contacts])
        for name, column in columns.items():
            if name not in self.datasets:
                kind = h5py_module().string_dtype() if name == "ids" else column.dtype
                self.datasets[name] = handle.create_dataset(name, shape=(0, *column.shape[1:]), dtype=kind,
                                                            maxshape=(None, *column.shape[1:]),
                                                            chunks=_chunk_shape(column))
            _append(self.datasets[name], column)

    def _pointers(self, dataset: str, sizes: list[int]) -> np.ndarray:
        """Where each of the records' rows ends in a ragged dataset (scikit-bio's pointers)."""
        ends = self._ends[dataset] + np.cumsum(sizes, dtype=np.int64)
        self._ends[dataset] = int(ends[-1])
        return ends


def _nbytes(chunk: Chunk) -> int:
    """The bytes of a chunk's arrays (what buffering it holds)."""
    arrays = [*chunk.pooled.values(), *(chunk.residues or []), *(chunk.contacts or [])]
    return sum(array.nbytes for array in arrays) + 100 * len(chunk)


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
    durable_replace(staging, out)
