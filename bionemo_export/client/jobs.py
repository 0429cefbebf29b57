"""Bulk encode jobs: a whole dataset through a served encoder, streamed, resumable and sharded.

    job = EncodeJob(model="esm2nv_embeddings", input=Path("uniref50.fasta.gz"), output=Path("uniref50/"))
    with ServerPool(["grpc://a:8001", "grpc://b:8001"], concurrency=4) as servers:
        summary = job.run(servers)

The input is read a record at a time (records.py) and cut into chunks of `chunk_size` records; a
chunk goes to the server in requests of the model's batch size, several in flight (batches.py),
and is written as one part (job_files.py) as soon as it is answered, then recorded in the
journal. Client memory is bounded by a chunk and what is in flight, never by the input.

- Resume: the same command again continues after the last part the journal records (a killed
  run loses at most the chunk it was writing); a different model, served configuration, input
  file or option is refused (the run's fingerprint).
- Duplicates: a sequence seen before in the run is not sent again; its record gets a copy of the
  first answer (found by the sequence's SHA-256 in the parts written).
- Records the server refuses are left out, listed with id, line and reason in the errors file,
  and the job ends "partial" (JobSummary.partial).
- `shard=(i, n)`: the records at positions i mod n of the input (a Slurm array, an Indexed Job).
- `include`: what is stored of each record (pooling.py): the mean, BOS or max pooling and/or the
  per-residue states, several from one answer of an `N_hiddens` model; and/or the contact map,
  asked of the repository's `N_contacts` for the same sequences (a record either model refuses is
  left out).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from bionemo_export.errors import InvalidInputError
from bionemo_export.tasks import sibling_model

from .batches import DEFAULT_IN_FLIGHT, MakeInputs, answered_together, infer_rows
from .job_files import (
    FORMATS,
    JOURNAL,
    SEEN_INDEX,
    Chunk,
    Journal,
    SeenSequences,
    errors_file,
    file_identity,
    metadata_file,
    parquet_column,
    part_name,
    read_digests,
    read_metadata,
    read_part,
    read_rows,
    sequence_digest,
    work_folder,
    write_hdf5,
    write_manifest,
    write_parquet,
    write_part,
)
from .memory import give_back_memory, map_large_blocks
from .pooling import CONTACTS, Include, served_contacts_model
from .records import ReadPosition, Record, iter_records
from .repository import contact_map, strings_column
from .server_pool import ServerPool
from .triton import Inferrer

DEFAULT_CHUNK_SIZE = 1024
PRECISIONS = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16)}


class PartMirror(Protocol):
    """A copy of a directory output kept elsewhere (runtime/job_storage.OutputMirror: s3://), told
    what the job does in the order that keeps the copy consistent."""

    def pull(self) -> None:
        """Before the run: bring the local folder up to where the copy is."""

    def part_finished(self, part: Path) -> None:
        """After `part` is recorded in the local journal."""

    def finished(self) -> None:
        """After the output is complete: a directory's manifest.json, or the single file, written."""

    @property
    def location(self) -> str:
        """Where the copy is, for the job's summary."""
        ...

    @property
    def errors_location(self) -> str:
        """Where the copy's errors file is, for the job's summary."""
        ...


@dataclass
class JobSummary:
    """The final account of a job, also stored in its metadata."""

    records: int = 0
    """Records of the input (its shard) the job covered, answered or not."""
    answered: int = 0
    sent: int = 0
    """Sequences sent to the server: duplicates are sent once."""
    residues: int = 0
    """Residues (sequence characters) of the records answered."""
    errors: int = 0
    busy_retries: int = 0
    """Requests sent again after a server turned them away for load (ServerPool)."""
    moved: int = 0
    """Requests sent to another server after theirs could not be reached (ServerPool)."""
    seconds: float = 0.0
    resumed_after: int = 0
    """Records an earlier run had already done."""
    output: str = ""
    errors_file: str | None = None

    @property
    def partial(self) -> bool:
        return self.errors > 0

    def line(self) -> str:
        rate = (self.records - self.resumed_after) / self.seconds if self.seconds else 0.0
        text = (f"{self.answered} of {self.records} records answered ({self.sent} sequences sent, "
                f"{self.residues} residues) in {self.seconds:.1f} s, {rate:.1f} records/s")
        if self.resumed_after:
            text += f"; resumed after {self.resumed_after} records"
        if self.busy_retries or self.moved:
            text += f"; {self.busy_retries} requests retried after a busy answer, {self.moved} moved off a server"
        if self.errors:
            text += f"; {self.errors} bad records listed in {self.errors_file}"
        return text + f"; wrote {self.output}"


@dataclass
class EncodeJob:
    """One dataset through one encoder model (N_embeddings: mean-pooled rows; N_hiddens: per-residue
    states and any pooling of them, as `include` says), and/or through the repository's N_contacts
    (`include` naming contacts: each record's contact map)."""

    model: str
    input: Path
    output: Path
    """A directory (parts + manifest.json), or an .h5 / .parquet file."""
    in_name: str = "sequences"
    shard: tuple[int, int] = (0, 1)
    chunk_size: int = DEFAULT_CHUNK_SIZE
    batch_size: int | None = None
    in_flight: int = DEFAULT_IN_FLIGHT
    precision: str = "fp32"
    sequence_column: str | None = None
    id_column: str | None = None
    include: str | None = None
    """Comma-separated choices of pooling.CHOICES (mean, bos, max, per_tok, contacts); None: what the
    model answers (an N_embeddings model's mean, an N_hiddens model's per-residue states, an
    N_contacts model's maps)."""
    layers: str | None = None
    """Comma-separated layers (ESM's numbering) for an N_layers model (`model`): each pooling of each
    layer stored (pooled rows; a layer other than the last under a `_layer<i>` name); None: the
    model's own answer."""
    source: str | None = None
    """What the fingerprint names as the input where `input` is a local copy (an s3:// location)."""
    mirror: PartMirror | None = None
    """Where a directory output is mirrored to (runtime/job_storage.py: object storage)."""
    progress: Callable[[int, int, float], None] = field(default=lambda records, residues, fraction: None)
    """Told (records, residues, fraction of the input read) each time a chunk is done: the CLI's
    rates and ETA."""

    def __post_init__(self) -> None:
        self.input, self.output = Path(self.input), Path(self.output)
        if self.precision not in PRECISIONS:
            raise InvalidInputError(f"precision {self.precision!r}: choose {' or '.join(PRECISIONS)}")
        if self.chunk_size < 1:
            raise InvalidInputError(f"chunk size must be at least 1, got {self.chunk_size}")
        if self.output.suffix and self.output.suffix not in FORMATS:
            raise InvalidInputError(f"--output {self.output}: give a directory, or a file ending in "
                                    f"{', '.join(FORMATS)}")

    # -- where things go ---------------------------------------------------------------------------------
    @property
    def is_directory(self) -> bool:
        return not self.output.suffix

    @property
    def work(self) -> Path:
        """The parts and the journal: the output directory itself, or `<output>.parts/` beside a file."""
        return work_folder(self.output)

    @property
    def errors_path(self) -> Path:
        return errors_file(self.output)

    @property
    def contacts_model(self) -> str:
        """The repository's N_contacts, which `include` naming contacts asks beside `model`."""
        return sibling_model(self.model, CONTACTS)

    # -- the run ------------------------------------------------------------------------------------------
    def stored(self, client: Inferrer) -> Include:
        """What the job stores of each record, checked against the model and the output's format."""
        config = client.model_config(self.model)
        if self.layers is not None:
            count = (config.get("parameters") or {}).get("num_layers", {}).get("string_value")
            if count is None:
                raise InvalidInputError(f"--layers: {self.model} is not an N_layers model (no num_layers parameter); "
                                        "build the repository with --tasks ...,layers")
            include = Include.for_layers(self.include, self.layers, int(count), self.model)
        else:
            outputs = {output["name"] for output in config.get("output", [])}
            include = Include.parse(self.include, outputs, self.model)
        if include.contacts:  # refused before anything is sent where the repository has no N_contacts
            served_contacts_model(client, self.model)
        if not self.is_directory and FORMATS[self.output.suffix] == "parquet" and (
                include.per_residue or include.contacts or not include.poolings):
            raise InvalidInputError(f"--output {self.output}: Parquet holds pooled rows ("
                                    f"{', '.join(map(parquet_column, ('mean', 'bos', 'max')))}); store per-residue "
                                    "states and contact maps in an .h5 file or a directory, or give --include mean "
                                    "(bos, max)")
        return include

    def fingerprint(self, client: Inferrer) -> dict[str, Any]:
        """What makes two runs the same run: a resume must match it."""
        identity = file_identity(self.input)
        include = self.stored(client)
        fingerprint = {"model": self.model, "model_config_sha256": _config_sha256(client, self.model),
                       "input": self.source or str(self.input.resolve()), "input_bytes": identity["bytes"],
                       "input_head_sha256": identity["head_sha256"],
                       "shard": f"{self.shard[0]}/{self.shard[1]}", "chunk_size": self.chunk_size,
                       "precision": self.precision, "in_name": self.in_name, "sequence_column": self.sequence_column,
                       "id_column": self.id_column, "include": include.text()}
        if include.contacts:  # only then: the fingerprints of jobs without maps stay what they were
            fingerprint["contacts_model_config_sha256"] = _config_sha256(client, self.contacts_model)
        return fingerprint

    def run(self, client: Inferrer) -> JobSummary:
        started = time.perf_counter()
        map_large_blocks()
        include = self.stored(client)
        fingerprint = self.fingerprint(client)
        if self.mirror is not None:
            self.mirror.pull()
        finished = self._finished(fingerprint)
        if finished is not None:
            return finished
        self.work.mkdir(parents=True, exist_ok=True)
        journal = Journal(self.work / JOURNAL)
        journal.start(fingerprint)
        self._remove_unrecorded_parts(journal)
        summary = JobSummary(resumed_after=journal.records_done)
        seen = self._seen(journal)
        position = ReadPosition()
        records = iter_records(self.input, shard=self.shard, sequence_column=self.sequence_column,
                               id_column=self.id_column, position=position)
        for chunk_records in _chunks(itertools.islice(records, journal.records_done, None), self.chunk_size):
            number = len(journal.parts)
            chunk = self._answer(client, chunk_records, seen, summary, include)
            name = part_name(number)
            write_part(self.work / name, chunk, PRECISIONS[self.precision])
            refused = {(error[0], error[1]) for error in chunk.errors}
            residues = sum(len(r.sequence) for r in chunk_records if (r.id, r.line) not in refused)
            journal.finished(name, len(chunk), residues, chunk.errors)
            if self.mirror is not None:
                self.mirror.part_finished(self.work / name)
            seen.add(number, chunk.digests)
            self.progress(len(chunk) + len(chunk.errors), residues, position.fraction())
            del chunk
            give_back_memory()  # the chunk's arrays: freed heap stays with the process unless given back
        seen.close()
        summary.seconds = time.perf_counter() - started
        if isinstance(client, ServerPool):
            summary.busy_retries, summary.moved = client.statistics.busy_retries, client.statistics.moved
        self._account(journal, summary)
        self._finish(journal, fingerprint, summary)
        return summary

    def _finished(self, fingerprint: dict[str, Any]) -> JobSummary | None:
        """The summary of this very job when it already finished (the same command run again: a job
        array's task started twice, a run killed while it cleaned up); a finished output of another
        job is refused."""
        metadata = read_metadata(metadata_file(self.output))
        if metadata is None:
            return None
        if metadata.get("fingerprint") != fingerprint:
            raise InvalidInputError(f"--output {self.output} holds another finished job; remove it or give another "
                                    "name")
        if not self.is_directory:
            shutil.rmtree(self.work, ignore_errors=True)  # a run killed after its output was in place
        return JobSummary(**{k: v for k, v in metadata["summary"].items() if k in JobSummary.__dataclass_fields__})

    def _answer(self, client: Inferrer, records: list[Record], seen: SeenSequences, summary: JobSummary,
                include: Include) -> Chunk:
        """One chunk through the server: each new sequence once, duplicates copied from their first answer."""
        digests = [sequence_digest(record.sequence) for record in records]
        earlier = self._earlier_answers(seen, [d for r, d in zip(records, digests) if r.sequence])
        fresh: dict[str, int] = {}  # digest -> row among the sequences sent
        sent: list[str] = []
        for record, digest in zip(records, digests):
            if record.sequence and digest not in earlier and digest not in fresh:
                fresh[digest] = len(sent)
                sent.append(record.sequence)
        column = strings_column(sent)
        asked: list[tuple[str, MakeInputs, list[str] | None]] = []  # the encoder and/or N_contacts, and what is kept
        if include.encodes:
            asked.append((self.model, lambda rows, _: {self.in_name: column[rows], **include.inputs(len(rows))}, None))
        if include.contacts:
            asked.append((self.contacts_model, lambda rows, _: {"sequences": column[rows]}, ["contacts", "mask"]))
        answers = answered_together([infer_rows(client, model, len(sent), make_inputs, outputs=outputs,
                                                 batch_size=self.batch_size, in_flight=self.in_flight, isolate=True)
                                     for model, make_inputs, outputs in asked])
        encoded = answers[0].outputs if include.encodes else None
        maps = answers[-1].outputs if include.contacts else None
        summary.sent += len(sent)
        answered = {int(row): position for position, row in enumerate(answers[0].rows)}
        refused = dict(answers[0].failures)
        rows: list[Chunk] = []
        errors: list[tuple[str, int, str]] = []
        for record, digest in zip(records, digests):
            if not record.sequence:
                errors.append((record.id, record.line, "no sequence"))
                continue
            if digest in fresh and fresh[digest] in refused:
                errors.append((record.id, record.line, refused[fresh[digest]]))
                continue
            if digest in fresh:
                position = answered[fresh[digest]]
                pooled, residues = include.record(encoded, position) if encoded is not None else ({}, None)
                row = Chunk(ids=[], index=[], digests=[], pooled={k: v[None] for k, v in pooled.items()},
                            residues=None if residues is None else [residues],
                            contacts=None if maps is None else [contact_map(maps, position)])
            else:
                row = earlier[digest]
            rows.append(Chunk(ids=[record.id], index=[record.index], digests=[digest], pooled=row.pooled,
                              residues=row.residues,
                              sequences=[record.sequence] if row.residues is not None else None,
                              contacts=row.contacts))
        chunk = Chunk.joined(rows)
        chunk.errors = errors
        return chunk

    def _earlier_answers(self, seen: SeenSequences, digests: list[str]) -> dict[str, Chunk]:
        """The answers of sequences first answered in earlier parts, read back (those rows only);
        a candidate whose stored digest differs (SeenSequences keys are 64 bits) is left out."""
        wanted: dict[int, dict[int, set[str]]] = {}  # part -> row -> the digests whose key points there
        for digest, (part, row) in seen.find(dict.fromkeys(digests)).items():
            wanted.setdefault(part, {}).setdefault(row, set()).add(digest)
        found: dict[str, Chunk] = {}
        for part, rows in wanted.items():
            for row, answer in read_rows(self.work / part_name(part), list(rows)).items():
                if answer.digests[0] in rows[row]:
                    found[answer.digests[0]] = answer
        return found

    def _seen(self, journal: Journal) -> SeenSequences:
        """Where each sequence was first answered: the index in the job's folder, made to agree
        with the parts the journal records."""
        seen = SeenSequences(self.work / SEEN_INDEX)
        seen.forget_parts_from(len(journal.parts))
        for number in range(seen.parts, len(journal.parts)):
            seen.add(number, read_digests(self.work / journal.parts[number]["part"]))
        return seen

    def _remove_unrecorded_parts(self, journal: Journal) -> None:
        """A part the journal does not list is what a stopped run was writing: it is written again."""
        recorded = {entry["part"] for entry in journal.parts}
        for path in self.work.glob("part-*.h5*"):
            if path.name not in recorded:
                path.unlink()

    def _account(self, journal: Journal, summary: JobSummary) -> None:
        errors = [error for entry in journal.parts for error in entry["errors"]]
        summary.records = journal.records_done
        summary.answered = sum(entry["records"] for entry in journal.parts)
        summary.errors = len(errors)
        summary.output = self.mirror.location if self.mirror is not None else str(self.output)
        if errors:
            summary.errors_file = self.mirror.errors_location if self.mirror is not None else str(self.errors_path)
            lines = ["id\tline\treason", *(f"{i}\t{line}\t{' '.join(reason.split())}" for i, line, reason in errors)]
            self.errors_path.write_text("\n".join(lines) + "\n")
        summary.residues = sum(entry["residues"] for entry in journal.parts)

    def _finish(self, journal: Journal, fingerprint: dict[str, Any], summary: JobSummary) -> None:
        from bionemo_export import __version__

        metadata = {"tool": f"bionemo-export {__version__}", "fingerprint": fingerprint,
                    "summary": {k: v for k, v in summary.__dict__.items()}}
        parts = [self.work / entry["part"] for entry in journal.parts]
        dtype = PRECISIONS[self.precision]
        if self.is_directory:
            for index_file in self.work.glob(SEEN_INDEX + "*"):  # with SQLite's -wal and -shm files
                index_file.unlink()
            write_manifest(self.output, metadata, [(entry["part"], entry["records"]) for entry in journal.parts])
            if self.mirror is not None:
                self.mirror.finished()
            return
        if FORMATS[self.output.suffix] == "hdf5":
            write_hdf5(map(read_part, parts), self.output, metadata, dtype)
        else:
            write_parquet(map(read_part, parts), self.output, metadata, dtype)
        if self.mirror is not None:
            self.mirror.finished()
        shutil.rmtree(self.work)


def _config_sha256(client: Inferrer, model: str) -> str:
    """The SHA-256 of the configuration the server serves `model` with (a run's fingerprint)."""
    return hashlib.sha256(json.dumps(client.model_config(model), sort_keys=True).encode()).hexdigest()


def _chunks(records: Iterator[Record], size: int) -> Iterator[list[Record]]:
    while chunk := list(itertools.islice(records, size)):
        yield chunk
