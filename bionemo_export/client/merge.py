"""The shards of one bulk job put back together (`bionemo-export client merge`).

    merge_shards([Path("out/shard-0"), Path("out/shard-1"), Path("out/shard-2")], Path("uniref50.h5"))

A job run as N shards (`client encode --shard I/N`: a Slurm array, a Kubernetes Indexed Job) leaves
N finished outputs, shard I holding the records at positions I mod N of the input. The merge checks
that they are the N shards of one job (the same fingerprint but for the shard: model, served
configuration, input file, options; every I from 0 to N-1 once, each finished) and writes them as
one output in the input's order, by each record's `index`, streaming: one chunk of each shard in
memory at a time. The result is what the same job run unsharded writes (the same rows, the same
order, the same metadata fingerprint): rerunning that unsharded command finds it finished. The
shards' errors files are joined in input order beside it.
"""

from __future__ import annotations

import heapq
import itertools
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from bionemo_export.errors import InvalidInputError

from .job_files import (
    FORMATS,
    Chunk,
    errors_file,
    fsync_folder,
    metadata_file,
    output_chunks,
    part_name,
    read_metadata,
    write_hdf5,
    write_manifest,
    write_parquet,
    write_part,
)
from .jobs import PRECISIONS, JobSummary
from .records import parse_shard

ROWS_PER_CHUNK = 1024
Row = tuple[int, Chunk]
"""(index in the input, the record as a chunk of one) of one record."""


def merge_shards(shards: Sequence[Path], out: Path) -> JobSummary:
    """Write the finished `shards` of one job as one output at `out` (a directory, .h5 or .parquet)."""
    if out.suffix and out.suffix not in FORMATS:
        raise InvalidInputError(f"--output {out}: give a directory, or a file ending in {', '.join(FORMATS)}")
    metadata = [_finished(path) for path in shards]
    fingerprint = _one_job(shards, [m["fingerprint"] for m in metadata])
    summary = _summed([m["summary"] for m in metadata], out)
    merged = {"tool": metadata[0].get("tool", ""), "fingerprint": fingerprint,
              "merged_from": [str(path) for path in shards]}
    existing = read_metadata(metadata_file(out))
    if existing is not None:
        if existing.get("fingerprint") != fingerprint:
            raise InvalidInputError(f"--output {out} holds another finished job; remove it or give another name")
        return JobSummary(**{k: v for k, v in existing["summary"].items() if k in JobSummary.__dataclass_fields__})
    if not out.suffix and out.exists() and any(out.iterdir()):
        raise InvalidInputError(f"--output {out} is a directory that holds something else; give a new or empty one")
    summary.errors_file = str(errors_file(out)) if summary.errors else None
    merged["summary"] = dict(summary.__dict__)
    dtype = PRECISIONS[fingerprint["precision"]]
    chunks = _rechunk(heapq.merge(*(_rows(path) for path in shards), key=lambda row: row[0]))
    if not out.suffix:
        _write_directory(chunks, out, merged, dtype, shards if summary.errors else [])
        return summary
    if summary.errors:
        _join_errors(shards, errors_file(out))
    if FORMATS[out.suffix] == "hdf5":
        write_hdf5(chunks, out, merged, dtype)
    else:
        write_parquet(chunks, out, merged, dtype)
    return summary


def _finished(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise InvalidInputError(f"{path}: no such shard output")
    metadata = read_metadata(metadata_file(path))
    if metadata is None:
        raise InvalidInputError(f"{path} is not a finished job output (no {metadata_file(path).name}): run that "
                                "shard to its end first (the same command resumes it), then merge")
    return metadata


def _one_job(shards: Sequence[Path], fingerprints: list[dict[str, Any]]) -> dict[str, Any]:
    """The fingerprint of the unsharded job these are the shards of; a clear error when they are not."""
    first = {k: v for k, v in fingerprints[0].items() if k != "shard"}
    for path, fingerprint in zip(shards[1:], fingerprints[1:], strict=True):
        for key in sorted(set(first) | set(fingerprint) - {"shard"}):
            if fingerprint.get(key) != first.get(key):
                raise InvalidInputError(f"{path} is not a shard of the same job as {shards[0]}: its {key} is "
                                        f"{fingerprint.get(key)!r}, not {first.get(key)!r}")
    found: dict[int, list[Path]] = {}
    counts = set()
    for path, fingerprint in zip(shards, fingerprints, strict=True):
        index, count = parse_shard(fingerprint["shard"])
        counts.add(count)
        found.setdefault(index, []).append(path)
    if len(counts) != 1:
        raise InvalidInputError(f"the shards split the input differently ({', '.join(f'N={n}' for n in sorted(counts))}"
                                "): give the shards of one job")
    count = counts.pop()
    twice = {index: paths for index, paths in found.items() if len(paths) > 1}
    if twice:
        index, paths = next(iter(sorted(twice.items())))
        raise InvalidInputError(f"shard {index}/{count} is given twice: {', '.join(map(str, paths))}")
    missing = [f"{index}/{count}" for index in range(count) if index not in found]
    if missing:
        raise InvalidInputError(f"shards {', '.join(missing)} are missing: give all {count} shards of the job")
    return {**first, "shard": "0/1"}


def _summed(summaries: list[dict[str, Any]], out: Path) -> JobSummary:
    """The shards' accounts as one: counts added, seconds the longest shard's (they ran side by side)."""
    summary = JobSummary(output=str(out))
    for field in fields(JobSummary):
        values = [s.get(field.name) for s in summaries]
        if field.name == "seconds":
            summary.seconds = max(float(v or 0) for v in values)
        elif field.type in ("int", int):
            setattr(summary, field.name, sum(int(v or 0) for v in values))
    return summary


def _rows(path: Path) -> Iterator[Row]:
    for chunk in output_chunks(path, ROWS_PER_CHUNK):
        for row in range(len(chunk)):
            yield chunk.index[row], chunk.rows([row])


def _rechunk(rows: Iterator[Row]) -> Iterator[Chunk]:
    while block := list(itertools.islice(rows, ROWS_PER_CHUNK)):
        yield Chunk.joined([record for _, record in block])


def _write_directory(chunks: Iterator[Chunk], out: Path, metadata: dict[str, Any], dtype: np.dtype,
                     with_errors: Sequence[Path]) -> None:
    """Parts, the joined errors of `with_errors` and a manifest, built in `<out>.writing/` and
    renamed into place (never half an output)."""
    staging = out.with_name(out.name + ".writing")
    shutil.rmtree(staging, ignore_errors=True)  # what a stopped merge left
    staging.mkdir(parents=True)
    parts = []
    for number, chunk in enumerate(chunks):
        name = part_name(number)
        write_part(staging / name, chunk, dtype)
        parts.append((name, len(chunk)))
    if with_errors:
        _join_errors(with_errors, staging / errors_file(out).name)  # errors.tsv, as in any directory output
    write_manifest(staging, metadata, parts)
    if out.exists():
        out.rmdir()  # empty: checked before the merge
    os.replace(staging, out)
    fsync_folder(out.parent)  # the parts and manifest were each put in place durably; now the folder's name


def _join_errors(shards: Sequence[Path], target: Path) -> None:
    """The shards' errors files as one at `target`, in input order (by line)."""
    rows = []
    for path in shards:
        listed = errors_file(path)
        if listed.is_file():
            rows.extend(line.split("\t") for line in listed.read_text().splitlines()[1:] if line)
    rows.sort(key=lambda columns: int(columns[1]))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(["id\tline\treason", *("\t".join(columns) for columns in rows)]) + "\n")

