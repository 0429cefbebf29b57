"""client/merge.py without a server: shard outputs made of hand-written parts are merged in input
order into each format, and every way of giving the wrong shards is refused with a message that
names the shard and the problem. (Shards of a real job: tests/e2e/test_encode_jobs.py.)"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from bionemo_export.client.job_files import (
    Chunk,
    output_chunks,
    write_hdf5,
    write_manifest,
    write_part,
)
from bionemo_export.client.merge import merge_shards
from bionemo_export.errors import InvalidInputError

FINGERPRINT = {"model": "esm2nv_embeddings", "input": "/data/in.fasta", "precision": "fp32", "chunk_size": 2}
WIDTH = 3


def _row(index: int) -> np.ndarray:
    return np.full(WIDTH, index, dtype=np.float32)


def _shard(folder: Path, index: int, count: int, total: int, *, per_residue: bool = False,
           errors: Sequence[tuple[str, int]] = (), **fingerprint) -> Path:
    """Shard index/count of a `total`-record job, as a finished directory output (two records a part)."""
    folder.mkdir(parents=True)
    positions = list(range(index, total, count))
    parts = []
    for number, start in enumerate(range(0, len(positions), 2)):
        rows = positions[start:start + 2]
        chunk = Chunk(ids=[f"r{i}" for i in rows], index=rows, digests=[f"{i:064x}" for i in rows])
        if per_residue:
            chunk.residues = [np.tile(_row(i), (i % 4 + 1, 1)) for i in rows]
            chunk.sequences = ["M" * (i % 4 + 1) for i in rows]
        else:
            chunk.pooled = {"mean": np.stack([_row(i) for i in rows])}
        write_part(folder / f"part-{number:05d}.h5", chunk, np.dtype(np.float32))
        parts.append((f"part-{number:05d}.h5", len(rows)))
    if errors:
        (folder / "errors.tsv").write_text("id\tline\treason\n" + "".join(f"{i}\t{line}\tbad\n" for i, line in errors))
    summary = {"records": len(positions) + len(errors), "answered": len(positions), "errors": len(errors),
               "seconds": 1.0 + index}
    write_manifest(folder, {"fingerprint": {**FINGERPRINT, "shard": f"{index}/{count}", **fingerprint},
                            "summary": summary}, parts)
    return folder


def test_shards_merge_in_input_order_into_every_format(tmp_path):
    shards = [_shard(tmp_path / f"s{i}", i, 3, 10, errors=[("x", 40 + i)] if i != 1 else []) for i in (2, 0, 1)]
    summary = merge_shards(shards, tmp_path / "all.parquet")
    table = pq.read_table(tmp_path / "all.parquet")
    assert table.column("index").to_pylist() == list(range(10))
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(10)]
    np.testing.assert_array_equal(np.array(table.column("embedding").to_pylist()),
                                  np.stack([_row(i) for i in range(10)]))
    metadata = json.loads(pq.read_schema(tmp_path / "all.parquet").metadata[b"bionemo_export"])
    assert metadata["fingerprint"] == {**FINGERPRINT, "shard": "0/1"}  # what the unsharded job writes
    assert (summary.answered, summary.errors, summary.seconds) == (10, 2, 3.0)  # counts add; the longest shard
    assert (tmp_path / "all.parquet.errors.tsv").read_text().splitlines() == [
        "id\tline\treason", "x\t40\tbad", "x\t42\tbad"]

    merge_shards(shards, tmp_path / "all")
    assert [i for chunk in output_chunks(tmp_path / "all") for i in chunk.index] == list(range(10))
    assert (tmp_path / "all" / "errors.tsv").is_file() and not (tmp_path / "all.writing").exists()


def test_ragged_per_residue_rows_survive_the_merge(tmp_path):
    shards = [_shard(tmp_path / f"s{i}", i, 2, 7, per_residue=True) for i in range(2)]
    merge_shards(shards, tmp_path / "all.h5")
    [chunk] = list(output_chunks(tmp_path / "all.h5"))
    assert chunk.index == list(range(7)) and chunk.residues is not None
    assert chunk.sequences == ["M" * (i % 4 + 1) for i in range(7)]  # each record's own, in order
    for i, residues in enumerate(chunk.residues):
        np.testing.assert_array_equal(residues, np.tile(_row(i), (i % 4 + 1, 1)))
    # Read back in blocks smaller than the file: the offsets of each block start at its first row.
    blocks = list(output_chunks(tmp_path / "all.h5", rows=3))
    assert [len(block) for block in blocks] == [3, 3, 1]
    np.testing.assert_array_equal(blocks[1].residues[0], np.tile(_row(3), (4, 1)))  # pyright: ignore[reportOptionalSubscript]


def test_a_finished_merge_is_found_finished(tmp_path):
    shards = [_shard(tmp_path / f"s{i}", i, 2, 4) for i in range(2)]
    merge_shards(shards, tmp_path / "all.h5")
    stamp = (tmp_path / "all.h5").stat().st_mtime_ns
    assert merge_shards(shards, tmp_path / "all.h5").answered == 4
    assert (tmp_path / "all.h5").stat().st_mtime_ns == stamp


@pytest.mark.parametrize(("make", "message"), [
    (lambda t: [_shard(t / "a", 0, 2, 4), _shard(t / "b", 1, 2, 4, model="other")],
     r"b is not a shard of the same job as .*a: its model is 'other', not 'esm2nv_embeddings'"),
    (lambda t: [_shard(t / "a", 0, 3, 6), _shard(t / "b", 1, 3, 6)], r"shards 2/3 are missing"),
    (lambda t: [_shard(t / "a", 0, 2, 4), _shard(t / "b", 0, 2, 4)], r"shard 0/2 is given twice: .*a, .*b"),
    (lambda t: [_shard(t / "a", 0, 2, 4), _shard(t / "b", 1, 3, 4)], r"split the input differently \(N=2, N=3\)"),
    (lambda t: [_shard(t / "a", 0, 2, 4), (t / "b").mkdir() or t / "b"],
     r"b is not a finished job output \(no manifest.json\): run that shard to its end first"),
])
def test_the_wrong_shards_are_refused_by_name(tmp_path, make, message):
    with pytest.raises(InvalidInputError, match=message):
        merge_shards(make(tmp_path), tmp_path / "all.h5")
    assert not (tmp_path / "all.h5").exists()


def test_an_output_that_holds_something_else_is_left_alone(tmp_path):
    shards = [_shard(tmp_path / f"s{i}", i, 2, 4) for i in range(2)]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(InvalidInputError, match="holds something else"):
        merge_shards(shards, tmp_path / "out")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    write_hdf5([], tmp_path / "other.h5", {"fingerprint": {"model": "x"}, "summary": {}}, np.dtype(np.float32))
    with pytest.raises(InvalidInputError, match="holds another finished job"):
        merge_shards(shards, tmp_path / "other.h5")
