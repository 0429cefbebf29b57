"""Bulk encode jobs: a whole dataset through a served encoder, streamed, resumable and sharded.

    job = EncodeJob(model="esm2nv_embeddings", input=Path("uniref50.fasta.gz"), output=Path("uniref50/"))
    with ServerPool(["grpc://a:8001", "grpc://b:8001"], concurrency=4) as servers:
        summary = job.run(servers)

The input is read a record at a time (records.py) and cut into chunks of `chunk_size` records; a
chunk goes to the server in requests of the model's batch size, several in flight
(job_answers.py), each record written to its part (job_files.Hdf5Writer) as soon as its request is
answered, cut to its own length and cast to the output's precision; the part is put in place
durably and recorded in the journal with its size and SHA-256. Client memory is bounded by the
requests in flight, never by the chunk (a chunk of per-residue states is never held whole) nor
the input.

- One owner: a run holds the output for its whole length (job_lock.LocalOutputLock, and the
  mirror's lease for s3://); a second run on it refuses at once, naming the holder.
- Resume: the same command again continues after the last part the journal records (a killed
  run loses at most the chunk it was writing), after checking every recorded part against its
  size and digest (from the first that does not match, the chunks are done again) and retrying
  the records an earlier version recorded as bad for a failure of the server's. A different
  model, served repository (job_identity.py), input file or option is refused (the run's
  fingerprint); the whole input's SHA-256, taken as it is read, must be the one an earlier run
  recorded at its end.
- A failure of the server's own (a deadline, a restarting stub, a lost connection) is never a
  bad record: retried by the ServerPool, and if it lasts the run stops, resumable.
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
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from bionemo_export.errors import InvalidInputError
from bionemo_export.tasks import sibling_model

from .batches import DEFAULT_IN_FLIGHT, MakeInputs
from .job_answers import request_answers
from .job_files import (
    FORMATS,
    JOURNAL,
    SEEN_INDEX,
    Chunk,
    Hdf5Writer,
    Journal,
    SeenSequences,
    durable_replace,
    errors_file,
    file_identity,
    hdf5_chunks,
    metadata_file,
    parquet_column,
    part_name,
    part_problem,
    read_digests,
    read_metadata,
    read_rows,
    sequence_digest,
    work_folder,
    write_hdf5,
    write_manifest,
    write_parquet,
)
from .job_identity import Asked, answers_differ, config_sha256, served_identity, source_sha256
from .job_lock import LOCK_FILE, LocalOutputLock, Notice, OutputLease
from .memory import give_back_memory, map_large_blocks
from .pooling import CONTACTS, Include, served_contacts_model
from .records import ReadPosition, Record, iter_records
from .repository import contact_map, strings_column
from .triton import Inferrer, is_transient

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

    def lease(self, notice: Notice) -> OutputLease:
        """The right to write the copy, held by the job for its whole run (a lease object beside it)."""
        ...

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
    transient_retries: int = 0
    """Requests sent again after a server failed them for a reason of its own (ServerPool)."""
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
        if self.transient_retries:
            text += f"; {self.transient_retries} requests retried after a failure of the server's"
        if self.errors:
            text += f"; {self.errors} bad records listed in {self.errors_file}"
        return text + f"; wrote {self.output}"


@dataclass(frozen=True)
class JobProgress:
    """Where a run stands, told to EncodeJob.progress as records are written (the CLI's line)."""

    records: int
    """Records this run wrote or listed as bad so far (not those an earlier run did)."""
    residues: int
    fraction: float
    """Of the input read (its bytes), for the time left."""
    errors: int
    """Bad records this run listed so far."""
    retries: int
    """Requests the servers had to be sent again so far (busy, moved, failed: ServerPool's statistics)."""


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
    progress: Callable[[JobProgress], None] = field(default=lambda progress: None)
    """Told where the run stands each time a request's records are written: the CLI's rates, ETA,
    errors and retries."""
    notice: Notice = field(default=lambda line: None)
    """Told one line the user should read: a dead run's lock taken over, a damaged part written again."""

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

    def asked(self, include: Include) -> list[Asked]:
        """The models the job asks for each record, and their requests' inputs besides the sequences."""
        asked = [Asked(self.model, self.in_name, include.inputs(1))] if include.encodes else []
        if include.contacts:
            asked.append(Asked(self.contacts_model, "sequences", {}))
        return asked

    def fingerprint(self, client: Inferrer, include: Include, repository: str) -> dict[str, Any]:
        """What makes two runs the same run: a resume must match it. `repository`: job_identity's
        repository_sha256 of what the servers serve."""
        identity = file_identity(self.input)
        fingerprint = {"model": self.model, "model_config_sha256": config_sha256(client, self.model),
                       "input": self.source or str(self.input.resolve()), "input_bytes": identity["bytes"],
                       "input_head_sha256": identity["head_sha256"],
                       "shard": f"{self.shard[0]}/{self.shard[1]}", "chunk_size": self.chunk_size,
                       "precision": self.precision, "in_name": self.in_name, "sequence_column": self.sequence_column,
                       "id_column": self.id_column, "include": include.text(), "repository_sha256": repository,
                       "source_sha256": source_sha256(client, self.model)}
        if include.contacts:  # only then: the fingerprints of jobs without maps stay what they were
            fingerprint["contacts_model_config_sha256"] = config_sha256(client, self.contacts_model)
        return fingerprint

    def run(self, client: Inferrer) -> JobSummary:
        started = time.perf_counter()
        map_large_blocks()
        include = self.stored(client)
        asked = self.asked(include)
        repository, answers = served_identity(client, asked, self._probe())
        fingerprint = self.fingerprint(client, include, repository)
        with ExitStack() as held:  # the output is this run's from here to the end, finishing included
            held.enter_context(LocalOutputLock(self.work / LOCK_FILE, self.notice))
            if self.mirror is not None:
                held.enter_context(self.mirror.lease(self.notice))
                self.mirror.pull()
            finished = self._finished(fingerprint)
            if finished is not None:
                return finished
            journal = Journal(self.work / JOURNAL)
            journal.start(_adopted(journal, fingerprint, self.notice))
            self._check_answers(journal, answers)
            self._verify_parts(journal)
            self._remove_unrecorded_parts(journal)
            summary = JobSummary(resumed_after=journal.records_done)
            self._encode(client, journal, include, asked, summary)
            summary.seconds = time.perf_counter() - started
            statistics = getattr(client, "statistics", None)
            if statistics is not None:  # a ServerPool's
                summary.busy_retries, summary.moved = statistics.busy_retries, statistics.moved
                summary.transient_retries = getattr(statistics, "transient_retries", 0)
            self._account(journal, summary)
            self._finish(journal, fingerprint, summary)
            return summary

    def _encode(self, client: Inferrer, journal: Journal, include: Include, asked: list[Asked],
                summary: JobSummary) -> None:
        """The chunks after those the journal records, each written as its requests are answered,
        then recorded; the whole input's digest checked at the end."""
        seen = self._seen(journal)
        position = ReadPosition()
        digest = _InputDigest(self.input, position)
        done = Progress(self, client)
        records = iter_records(self.input, shard=self.shard, sequence_column=self.sequence_column,
                               id_column=self.id_column, position=position)
        try:
            for chunk_records in _chunks(itertools.islice(records, journal.records_done, None), self.chunk_size):
                number = len(journal.parts)
                path = self.work / part_name(number)
                with Hdf5Writer(path, {}, PRECISIONS[self.precision]) as part:
                    digests, errors = self._answer(client, chunk_records, seen, summary, include, asked, part,
                                                   done, digest)
                refused = {(error[0], error[1]) for error in errors}
                residues = sum(len(r.sequence) for r in chunk_records if (r.id, r.line) not in refused)
                journal.finished(path, part.records, residues, errors)
                if self.mirror is not None:
                    self.mirror.part_finished(path)
                seen.add(number, digests)
                give_back_memory()  # the chunk's arrays: freed heap stays with the process unless given back
            whole = digest.finish()
        finally:
            seen.close()
            digest.handle.close()
        self._check_input(journal, whole)

    def _answer(self, client: Inferrer, records: list[Record], seen: SeenSequences, summary: JobSummary,
                include: Include, asked: list[Asked], part: Hdf5Writer, done: Progress,
                digest: _InputDigest) -> tuple[list[str], list[tuple[str, int, str]]]:
        """One chunk through the server, each record written to `part` in input order as soon as its
        answer is there: each new sequence sent once, duplicates copied from their first answer (an
        earlier part's read back when its turn comes). (The digests of the records written, the
        records left out with their reasons.)"""
        dtype = PRECISIONS[self.precision]
        digests = [sequence_digest(record.sequence) for record in records]
        earlier = self._earlier_answers(seen, [d for r, d in zip(records, digests) if r.sequence])
        fresh: dict[str, int] = {}  # digest -> row among the sequences sent
        sent: list[str] = []
        for record, digest_ in zip(records, digests):
            if record.sequence and digest_ not in earlier and digest_ not in fresh:
                fresh[digest_] = len(sent)
                sent.append(record.sequence)
        uses = Counter(digest_ for record, digest_ in zip(records, digests) if digest_ in fresh)
        column = strings_column(sent)
        calls: list[tuple[str, MakeInputs, list[str] | None]] = []  # the encoder and/or N_contacts, and what is kept
        if include.encodes:
            calls.append((self.model, lambda rows, _: {self.in_name: column[rows], **include.inputs(len(rows))}, None))
        if include.contacts:
            calls.append((self.contacts_model, lambda rows, _: {"sequences": column[rows]}, ["contacts", "mask"]))
        answered: dict[int, Chunk] = {}  # row sent -> its stored values, until its last record is written
        refused: dict[int, str] = {}
        written: list[str] = []
        errors: list[tuple[str, int, str]] = []
        next_record = 0

        def write_ready() -> None:
            """Every record from `next_record` on whose answer (or refusal) is known, in order."""
            nonlocal next_record
            while next_record < len(records):
                record, digest_ = records[next_record], digests[next_record]
                if not record.sequence:
                    errors.append((record.id, record.line, "no sequence"))
                elif digest_ in earlier:
                    part_number, row = earlier[digest_]
                    self._write(part, record, digest_, read_rows(self.work / part_name(part_number), [row])[row])
                    written.append(digest_)
                elif fresh[digest_] in refused:
                    errors.append((record.id, record.line, refused[fresh[digest_]]))
                elif fresh[digest_] in answered:
                    row = fresh[digest_]
                    self._write(part, record, digest_, answered[row])
                    written.append(digest_)
                    uses[digest_] -= 1
                    if not uses[digest_]:
                        del answered[row]
                else:
                    return  # its request is not answered yet
                next_record += 1

        if sent:
            for answer in request_answers(client, calls, len(sent), batch_size=self.batch_size,
                                          in_flight=self.in_flight):
                encoded = answer.outputs[0] if include.encodes else None
                maps = answer.outputs[-1] if include.contacts else None
                for position, row in enumerate(answer.rows):
                    pooled, residues = include.record(encoded, position) if encoded is not None else ({}, None)
                    answered[int(row)] = Chunk(
                        ids=[], index=[], digests=[], pooled={k: v[None].astype(dtype) for k, v in pooled.items()},
                        residues=None if residues is None else [residues.astype(dtype)],
                        contacts=None if maps is None else [contact_map(maps, position).astype(dtype)])
                refused.update(answer.failures)
                first, listed = next_record, len(errors)
                write_ready()
                del answer, encoded, maps
                give_back_memory()  # the request's arrays: freed heap is kept until given back, and grows
                done.told(records[first:next_record], len(errors) - listed, digest)
        first, listed = next_record, len(errors)
        write_ready()
        done.told(records[first:next_record], len(errors) - listed, digest)
        summary.sent += len(sent)
        return written, errors

    def _write(self, part: Hdf5Writer, record: Record, digest: str, answer: Chunk) -> None:
        part.add(Chunk(ids=[record.id], index=[record.index], digests=[digest], pooled=answer.pooled,
                       residues=answer.residues, sequences=[record.sequence] if answer.residues is not None else None,
                       contacts=answer.contacts))

    def _earlier_answers(self, seen: SeenSequences, digests: list[str]) -> dict[str, tuple[int, int]]:
        """digest -> (part, row) of the sequences first answered in earlier parts, confirmed against
        the digests stored there (SeenSequences keys are 64 bits); the values are read when written."""
        wanted: dict[int, dict[int, set[str]]] = {}  # part -> row -> the digests whose key points there
        for digest, (part, row) in seen.find(dict.fromkeys(digests)).items():
            wanted.setdefault(part, {}).setdefault(row, set()).add(digest)
        found: dict[str, tuple[int, int]] = {}
        for part, rows in wanted.items():
            stored = read_digests(self.work / part_name(part))
            for row, candidates in rows.items():
                if stored[row] in candidates:
                    found[stored[row]] = (part, row)
        return found

    def _seen(self, journal: Journal) -> SeenSequences:
        """Where each sequence was first answered: the index in the job's folder, made to agree
        with the parts the journal records."""
        seen = SeenSequences(self.work / SEEN_INDEX)
        seen.forget_parts_from(len(journal.parts))
        for number in range(seen.parts, len(journal.parts)):
            seen.add(number, read_digests(self.work / journal.parts[number]["part"]))
        return seen

    # -- checks of what an earlier run left ----------------------------------------------------------------
    def _probe(self) -> Record | None:
        """The record every run and shard of this input asks the servers first (job_identity.py):
        the input's first with a sequence."""
        for record in itertools.islice(iter_records(self.input, sequence_column=self.sequence_column,
                                                    id_column=self.id_column), 100):
            if record.sequence:
                return record
        return None

    def _check_answers(self, journal: Journal, answers: dict[str, Any]) -> None:
        """The servers answer the probe as they did for the runs before (the same weights), else the
        run is refused: a repository rebuilt from another checkpoint under the same names."""
        recorded = journal.notes.get("probe_answers")
        if recorded is None:
            journal.note("probe_answers", answers)
            return
        differing = answers_differ(recorded, answers)
        if differing:
            raise InvalidInputError(f"{journal.path}: the server answers {', '.join(differing)} otherwise than when "
                                    "this job started (the repository was rebuilt from another checkpoint under the "
                                    "same names): its parts hold the other model's answers; serve that repository "
                                    "again to finish the job, or give another --output")

    def _verify_parts(self, journal: Journal) -> None:
        """Every recorded part checked against its size and SHA-256, and the records an earlier version
        listed as bad for a failure of the server's: from the first part that fails, the chunks are
        done again (the journal is cut back to the parts before it)."""
        for (number, entry), listed in zip(enumerate(journal.parts), journal.errors(), strict=True):
            path = self.work / entry["part"]
            problem = part_problem(path, entry)
            if problem is None:
                transient = [error for error in listed if is_transient(str(error[2]))]
                if transient:
                    problem = (f"{len(transient)} of its records were listed as bad for a failure of the server's "
                               f"({' '.join(str(transient[0][2]).split())[:120]}); they are asked again")
            if problem is not None:
                self.notice(f"{path}: {problem}; writing the job again from this part "
                            f"({len(journal.parts) - number} of {len(journal.parts)} parts)")
                journal.keep(number)
                return

    def _check_input(self, journal: Journal, sha256: str) -> None:
        """The whole input's SHA-256, read as it went by: recorded by the first run to reach the end;
        another at a later end means the input changed between runs, and the job does not finish."""
        recorded = journal.notes.get("input_sha256")
        if recorded is None:
            journal.note("input_sha256", sha256)
        elif recorded != sha256:
            raise InvalidInputError(f"--input {self.source or self.input} changed while this job ran: its SHA-256 is "
                                    f"{sha256[:16]}... now, {recorded[:16]}... when an earlier run read it to its end; "
                                    "the parts hold records of both. Give the input it had (or start again into "
                                    "another --output)")

    def _finished(self, fingerprint: dict[str, Any]) -> JobSummary | None:
        """The summary of this very job when it already finished (the same command run again: a job
        array's task started twice, a run killed while it cleaned up); a finished output of another
        job is refused."""
        metadata = read_metadata(metadata_file(self.output))
        if metadata is None:
            return None
        recorded = metadata.get("fingerprint") or {}
        if {**{key: fingerprint[key] for key in ADDED_KEYS if key in fingerprint}, **recorded} != fingerprint:
            raise InvalidInputError(f"--output {self.output} holds another finished job; remove it or give another "
                                    "name")  # (an earlier version's finished job lacks the keys it could not know)
        if not self.is_directory:
            shutil.rmtree(self.work, ignore_errors=True)  # a run killed after its output was in place
        return JobSummary(**{k: v for k, v in metadata["summary"].items() if k in JobSummary.__dataclass_fields__})

    def _remove_unrecorded_parts(self, journal: Journal) -> None:
        """A part the journal does not list is what a stopped run was writing: it is written again."""
        recorded = {entry["part"] for entry in journal.parts}
        for path in self.work.glob("part-*.h5*"):
            if path.name not in recorded:
                path.unlink()

    # -- the end ------------------------------------------------------------------------------------------
    def _account(self, journal: Journal, summary: JobSummary) -> None:
        summary.records = journal.records_done
        summary.answered = sum(entry["records"] for entry in journal.parts)
        summary.errors = sum(entry["error_count"] for entry in journal.parts)
        summary.output = self.mirror.location if self.mirror is not None else str(self.output)
        if summary.errors:
            summary.errors_file = self.mirror.errors_location if self.mirror is not None else str(self.errors_path)
            staging = self.errors_path.with_name(self.errors_path.name + ".writing")
            with staging.open("w") as listed:  # streamed from the journal: never all errors in memory
                listed.write("id\tline\treason\n")
                for errors in journal.errors():
                    for i, line, reason in errors:
                        listed.write(f"{i}\t{line}\t{' '.join(str(reason).split())}\n")
            durable_replace(staging, self.errors_path)
        summary.residues = sum(entry["residues"] for entry in journal.parts)

    def _finish(self, journal: Journal, fingerprint: dict[str, Any], summary: JobSummary) -> None:
        from bionemo_export import __version__

        metadata = {"tool": f"bionemo-export {__version__}", "fingerprint": fingerprint,
                    "summary": {k: v for k, v in summary.__dict__.items()}, **journal.notes}
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
            write_hdf5(_records_of(parts), self.output, metadata, dtype)
        else:
            write_parquet(_records_of(parts), self.output, metadata, dtype)
        if self.mirror is not None:
            self.mirror.finished()
        shutil.rmtree(self.work)


class Progress:
    """What a run has done so far, told to the job's `progress` as records are written."""

    def __init__(self, job: EncodeJob, client: Inferrer) -> None:
        self.job, self.client = job, client
        self.errors = 0

    def told(self, records: list[Record], errors: int, digest: _InputDigest) -> None:
        """`records` were just written or listed as bad, `errors` of them bad."""
        if not records:
            return
        self.errors += errors
        statistics = getattr(self.client, "statistics", None)
        retries = 0 if statistics is None else (statistics.busy_retries + statistics.moved
                                                + getattr(statistics, "transient_retries", 0))
        residues = sum(len(record.sequence) for record in records)
        digest.follow()
        self.job.progress(JobProgress(records=len(records), residues=residues, fraction=digest.position.fraction(),
                                      errors=self.errors, retries=retries))


class _InputDigest:
    """The whole input's SHA-256, taken as the records are read: a second handle on the file reads
    up to where the reading stands (the same bytes, from the page cache), and to its end at `finish`."""

    def __init__(self, path: Path, position: ReadPosition) -> None:
        self.position = position
        self.handle = path.open("rb")
        self.size = path.stat().st_size
        self.sha256 = hashlib.sha256()

    def follow(self) -> None:
        self._read_to(int(self.position.fraction() * self.size))

    def finish(self) -> str:
        """The whole file's SHA-256, once its records are all read."""
        self._read_to(None)
        return self.sha256.hexdigest()

    def _read_to(self, offset: int | None) -> None:
        while offset is None or self.handle.tell() < offset:
            block = self.handle.read(1 << 20 if offset is None else min(1 << 20, offset - self.handle.tell()))
            if not block:
                return
            self.sha256.update(block)


ADDED_KEYS = ("repository_sha256", "source_sha256")
"""Fingerprint keys this version added: a journal of an earlier version without them is resumed."""


def _adopted(journal: Journal, fingerprint: dict[str, Any], notice: Notice) -> dict[str, Any]:
    """The fingerprint a resume of `journal` must match: a journal of an earlier version lacks the
    keys of ADDED_KEYS (it could not know them); where all else agrees, they are recorded now."""
    old = journal.fingerprint
    missing = [key for key in ADDED_KEYS if old is not None and key in fingerprint and key not in old]
    if old is not None and missing and {**old, **{key: fingerprint[key] for key in missing}} == fingerprint:
        notice(f"{journal.path}: a journal of an earlier version; the served repository's identity is recorded "
               "from now on")
        journal.fingerprint = fingerprint
        journal.keep(len(journal.parts))
    return fingerprint


def _records_of(parts: list[Path]) -> Iterator[Chunk]:
    """The parts' records in order, a slice of a part at a time (a single-file output is written
    within the same memory as the parts were)."""
    for part in parts:
        yield from hdf5_chunks(part)


def _chunks(records: Iterator[Record], size: int) -> Iterator[list[Record]]:
    while chunk := list(itertools.islice(records, size)):
        yield chunk
