"""The files of bulk encode jobs (client/job_files.py): parts, merged HDF5 and Parquet, the journal."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from bionemo_export.client.job_files import (
    Chunk,
    Journal,
    SeenSequences,
    durable_replace,
    h5py_module,
    hdf5_chunks,
    output_chunks,
    part_name,
    part_problem,
    read_digests,
    read_part,
    read_rows,
    sequence_digest,
    write_hdf5,
    write_parquet,
    write_part,
)

RNG = np.random.default_rng(0)


def _chunk(start: int, lengths: list[int], width: int = 4) -> Chunk:
    ids = [f"r{start + i}" for i in range(len(lengths))]
    sequences = ["".join(RNG.choice(list("ACDEFGHIKLMNPQRSTVWY"), n)) for n in lengths]
    return Chunk(ids=ids, index=list(range(start, start + len(lengths))),
                 digests=[sequence_digest(s) for s in sequences],
                 pooled={"mean": RNG.standard_normal((len(lengths), width)).astype(np.float32),
                         "max": RNG.standard_normal((len(lengths), width)).astype(np.float32)},
                 residues=[RNG.standard_normal((n, width)).astype(np.float32) for n in lengths], sequences=sequences)


def test_a_part_round_trips_ragged_and_reads_single_rows(tmp_path):
    chunk = _chunk(0, [3, 1, 5])
    write_part(tmp_path / "part.h5", chunk, np.dtype(np.float32))
    back = read_part(tmp_path / "part.h5")
    assert (back.ids, back.index, back.digests) == (chunk.ids, chunk.index, chunk.digests)
    assert back.pooled.keys() == {"mean", "max"} and back.sequences == chunk.sequences
    for pooling, rows in chunk.pooled.items():
        np.testing.assert_array_equal(back.pooled[pooling], rows)
    assert back.residues is not None and chunk.residues is not None
    for got, want in zip(back.residues, chunk.residues):
        np.testing.assert_array_equal(got, want)
    assert read_digests(tmp_path / "part.h5") == chunk.digests
    one = read_rows(tmp_path / "part.h5", [2])[2]
    assert one.digests == [chunk.digests[2]] and one.sequences == [chunk.sequences[2]]  # pyright: ignore[reportOptionalSubscript]
    assert one.residues is not None
    np.testing.assert_array_equal(one.residues[0], chunk.residues[2])
    np.testing.assert_array_equal(one.pooled["max"], chunk.pooled["max"][2:3])
    assert [p.name for p in tmp_path.iterdir()] == ["part.h5"]  # written beside, then renamed


def test_a_part_is_read_back_in_slices_bounded_by_its_ragged_values(tmp_path):
    """Records of 3, 1, 5, 2 and 6 residues (width 4) read with at most 16 values a slice: [3],
    [1], [5] ... each alone where two would not fit, a record over the bound alone, nothing lost."""
    chunk = _chunk(0, [3, 1, 5, 2, 6])
    write_part(tmp_path / "part.h5", chunk, np.dtype(np.float32))
    slices = list(hdf5_chunks(tmp_path / "part.h5", rows=4, values=16))
    assert [s.ids for s in slices] == [["r0", "r1"], ["r2"], ["r3"], ["r4"]]
    assert chunk.residues is not None
    back = [r for s in slices for r in s.residues or []]
    for got, want in zip(back, chunk.residues, strict=True):
        np.testing.assert_array_equal(got, want)
    assert [s.ids for s in hdf5_chunks(tmp_path / "part.h5", rows=2)] == [["r0", "r1"], ["r2", "r3"], ["r4"]]


def test_parts_merge_into_one_file_without_padding(tmp_path):
    chunks = [_chunk(0, [3, 1]), _chunk(2, []), _chunk(2, [2, 6, 1])]
    for number, chunk in enumerate(chunks):
        if chunk.ids:
            write_part(tmp_path / f"part-{number}.h5", chunk, np.dtype(np.float32))
    parts = sorted(tmp_path.glob("part-*.h5"))
    write_hdf5(map(read_part, parts), tmp_path / "all.h5", {"model": "m", "summary": {"records": 5}},
               np.dtype(np.float16))
    merged: Any
    with h5py_module().File(tmp_path / "all.h5") as merged:
        handle: dict = {name: merged[name][()] for name in ("ids", "embeddings", "embeddings_max", "embedding",
                                                          "embedding_ptr", "id", "idptr")}
        assert merged.attrs["model"] == "m" and json.loads(merged.attrs["summary"]) == {"records": 5}
        attributes = {k: merged.attrs[k] for k in ("format", "format-version", "dtype", "dim")}
    assert attributes == {"format": "embedding", "format-version": "1.0", "dtype": "float16", "dim": 4}
    assert [i.decode() for i in handle["ids"]] == ["r0", "r1", "r2", "r3", "r4"]
    assert handle["embeddings"].dtype == np.float16 and handle["embedding_ptr"].tolist() == [3, 4, 6, 12, 13]
    every = [r for chunk in chunks for r in chunk.residues or []]
    np.testing.assert_allclose(handle["embedding"], np.concatenate(every), atol=1e-2)
    sequences = [s for chunk in chunks for s in chunk.sequences or []]
    assert handle["id"].tobytes().decode() == "".join(sequences)
    assert handle["idptr"].tolist() == np.cumsum([len(s) for s in sequences]).tolist()

    write_parquet(map(read_part, parts), tmp_path / "all.parquet", {"model": "m"}, np.dtype(np.float32))
    table = pq.read_table(tmp_path / "all.parquet")
    assert table.column("id").to_pylist() == ["r0", "r1", "r2", "r3", "r4"]
    for column, pooling in (("embedding", "mean"), ("embedding_max", "max")):
        np.testing.assert_array_equal(np.array(table.column(column).to_pylist(), dtype=np.float32),
                                      np.concatenate([c.pooled[pooling] for c in chunks]))
    assert json.loads(table.schema.metadata[b"bionemo_export"]) == {"model": "m"}


def test_the_journal_keeps_what_finished_and_refuses_another_run(tmp_path):
    for number in range(2):
        write_part(tmp_path / part_name(number), _chunk(0, [3]), np.dtype(np.float32))
    journal = Journal(tmp_path / "journal.jsonl")
    journal.start({"model": "a", "input": "x"})
    journal.finished(tmp_path / "part-00000.h5", records=8, residues=40, errors=[("bad", 3, "invalid character")])
    with (tmp_path / "journal.jsonl").open("a") as handle:
        handle.write('{"part": "part-00001.h5", "reco')  # a run killed while writing its line
    again = Journal(tmp_path / "journal.jsonl")
    again.start({"model": "a", "input": "x"})
    assert [entry["part"] for entry in again.parts] == ["part-00000.h5"] and again.records_done == 9
    again.finished(tmp_path / "part-00001.h5", records=2, residues=7, errors=[])  # on a line of its own
    assert [entry["part"] for entry in Journal(tmp_path / "journal.jsonl").parts] == ["part-00000.h5", "part-00001.h5"]
    with pytest.raises(ValueError, match="another run .*model was 'a', now 'b'"):
        Journal(tmp_path / "journal.jsonl").start({"model": "b", "input": "x"})


def test_seen_sequences_find_first_answers_and_agree_with_the_journal(tmp_path):
    seen = SeenSequences(tmp_path / "seen.sqlite")
    digests = [sequence_digest(f"SEQ{i}") for i in range(1_000)]
    for part in range(10):
        seen.add(part, digests[part * 100:(part + 1) * 100])
    seen.add(10, digests[:50])  # later answers of the same sequences: the first ones stay
    assert len(seen) == 1_000 and seen.parts == 10
    found = seen.find([*digests, sequence_digest("never added")])
    assert found == {digest: (i // 100, i % 100) for i, digest in enumerate(digests)}
    seen.close()
    # Reopened after a stop whose journal records 7 parts: what parts 7.. added is forgotten.
    again = SeenSequences(tmp_path / "seen.sqlite")
    again.forget_parts_from(7)
    assert again.parts == 7 and len(again) == 700
    assert again.find(digests[650:750]) == {d: (6, 50 + i) for i, d in enumerate(digests[650:700])}


def test_two_sequences_sharing_a_64_bit_key_are_never_taken_for_each_other(tmp_path):
    """SeenSequences keys on 64 bits of the digest; the job confirms a hit against the full digest
    stored in the part, so a collision is sent to the server, never given another sequence's answer."""
    from bionemo_export.client.jobs import EncodeJob

    job = EncodeJob(model="m", input=tmp_path / "in.fasta", output=tmp_path / "out")
    job.work.mkdir()
    first = sequence_digest("MKT")
    twin = first[:16] + ("0" if first[16] != "0" else "1") + first[17:]  # the same key, another sequence
    write_part(job.work / "part-00000.h5", Chunk(ids=["a"], index=[0], digests=[first],
                                                 pooled={"mean": np.ones((1, 2), np.float32)}), np.dtype(np.float32))
    seen = SeenSequences(tmp_path / "seen.sqlite")
    seen.add(0, [first])
    assert seen.find([twin]) == {twin: (0, 0)}  # a candidate ...
    found = job._earlier_answers(seen, [first, twin])
    assert list(found) == [first]  # ... that the stored digest turns down


def test_other_layers_poolings_get_a_layer_suffix_and_round_trip(tmp_path):
    """An N_layers job (--layers 20,-1): the last layer keeps today's names, layer 20 is stored as
    embeddings_layer20 / embeddings_bos_layer20 (Parquet: embedding_layer20, ...), read back under
    the same keys (merging)."""
    from bionemo_export.client.job_files import output_chunks, parquet_column, pooled_dataset, pooled_key

    assert [pooled_dataset(k) for k in ("mean", "bos@20", "max@0")] == ["embeddings", "embeddings_bos_layer20",
                                                                       "embeddings_max_layer0"]
    assert [pooled_key(n) for n in ("embeddings", "embeddings_bos_layer20", "embedding", "embedding_ptr")] == \
        ["mean", "bos@20", None, None]
    assert parquet_column("mean@20") == "embedding_layer20"
    chunk = _chunk(0, [3, 1])
    chunk.residues = chunk.sequences = None
    chunk.pooled["mean@20"] = chunk.pooled["mean"] + 1
    chunk.pooled["bos@20"] = chunk.pooled["mean"] - 1
    write_part(tmp_path / "part.h5", chunk, np.dtype(np.float32))
    with h5py_module().File(tmp_path / "part.h5") as handle:
        assert {"embeddings", "embeddings_max", "embeddings_layer20", "embeddings_bos_layer20"} <= set(handle)
    back = read_part(tmp_path / "part.h5")
    assert back.pooled.keys() == chunk.pooled.keys()
    for key, rows in chunk.pooled.items():
        np.testing.assert_array_equal(back.pooled[key], rows)
    write_parquet([back], tmp_path / "all.parquet", {"model": "m"}, np.dtype(np.float32))
    assert {"embedding", "embedding_max", "embedding_layer20", "embedding_bos_layer20"} <= \
        set(pq.read_table(tmp_path / "all.parquet").schema.names)
    (again,) = output_chunks(tmp_path / "all.parquet")
    for key, rows in chunk.pooled.items():
        np.testing.assert_array_equal(again.pooled[key], rows)


def test_durable_replace_puts_the_whole_file_in_place_and_leaves_no_staging(tmp_path):
    (tmp_path / "out.json").write_text("old")
    (tmp_path / "out.json.writing").write_text("new")
    durable_replace(tmp_path / "out.json.writing", tmp_path / "out.json")
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"] and (tmp_path / "out.json").read_text() == "new"


def test_part_names_read_back_must_be_parts_of_the_folder(tmp_path):
    """A journal naming ../../x and a manifest naming /etc/passwd are refused naming the file and the
    name, before anything is read or written under them."""
    journal = tmp_path / "job" / "journal.jsonl"
    journal.parent.mkdir()
    journal.write_text(json.dumps({"fingerprint": {}}) + "\n"
                       + json.dumps({"part": "../../x", "records": 1, "residues": 1, "errors": []}) + "\n")
    with pytest.raises(ValueError, match=f"{journal} names the part '../../x', which is not a part file"):
        Journal(journal)
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "manifest.json").write_text(json.dumps({"parts": [{"file": "/etc/passwd", "records": 1}]}))
    with pytest.raises(ValueError, match="manifest.json names the part '/etc/passwd'"):
        list(output_chunks(tmp_path / "done"))


def test_a_recorded_part_that_changed_is_found(tmp_path):
    """The journal's size and SHA-256 of a part: a truncated part and one flipped byte are found; an
    entry of an earlier version (no digest) is checked by opening the part and counting its records."""
    path = tmp_path / part_name(0)
    write_part(path, _chunk(0, [3, 4]), np.dtype(np.float32))
    journal = Journal(tmp_path / "journal.jsonl")
    journal.start({"model": "a"})
    journal.finished(path, records=2, residues=7, errors=[])
    entry = Journal(tmp_path / "journal.jsonl").parts[0]
    assert part_problem(path, entry) is None and entry["bytes"] == path.stat().st_size
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert "SHA-256" in (part_problem(path, entry) or "")
    path.write_bytes(bytes(data[:-100]))
    assert "bytes, the journal recorded" in (part_problem(path, entry) or "")
    old = {"part": path.name, "records": 2}
    assert "does not open as a part" in (part_problem(path, old) or "")
    write_part(path, _chunk(0, [3]), np.dtype(np.float32))
    assert "holds 1 records, the journal recorded 2" in (part_problem(path, old) or "")
    path.unlink()
    assert part_problem(path, entry) == "it is missing"


def test_a_shortened_journal_keeps_the_errors_of_the_parts_it_keeps(tmp_path):
    journal = Journal(tmp_path / "journal.jsonl")
    journal.start({"model": "a"})
    for number in range(3):
        write_part(tmp_path / part_name(number), _chunk(0, [2]), np.dtype(np.float32))
        journal.finished(tmp_path / part_name(number), records=1, residues=2, errors=[(f"bad{number}", number, "x")])
    journal.note("input_sha256", "abc")
    journal.keep(2)
    again = Journal(tmp_path / "journal.jsonl")
    assert [entry["part"] for entry in again.parts] == [part_name(0), part_name(1)] and again.records_done == 4
    assert list(again.errors()) == [[["bad0", 0, "x"]], [["bad1", 1, "x"]]] and again.notes == {"input_sha256": "abc"}
