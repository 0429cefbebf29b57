"""Input records read as a stream (client/records.py): FASTA, tables, one per line, gzip, shards,
and a file far larger than what the reader holds."""

from __future__ import annotations

import gzip
import itertools
import tracemalloc

import pytest

from bionemo_export.client.records import ReadPosition, Record, iter_records, parse_shard, read_records
from bionemo_export.errors import InvalidInputError

FASTA = """# a comment before the first record
>sp|P1|ONE first protein
MKT AY
IAK
; an old-style comment
>P2
MKV
>P3 empty

>P4
ACDE
"""


def test_fasta_records_keep_ids_lines_and_positions(tmp_path):
    path = tmp_path / "in.fasta"
    path.write_text(FASTA)
    assert read_records(path) == [Record("sp|P1|ONE", "MKTAYIAK", 2, 0), Record("P2", "MKV", 6, 1),
                                  Record("P3", "", 8, 2), Record("P4", "ACDE", 10, 3)]
    windows = tmp_path / "crlf.fasta"
    windows.write_bytes(b"\r\n>two desc\r\nMSL KRK\r\n")
    assert read_records(windows) == [Record("two", "MSLKRK", 2, 0)]


def test_gzip_is_read_directly(tmp_path):
    path = tmp_path / "in.fasta.gz"
    with gzip.open(path, "wt") as handle:
        handle.write(FASTA)
    plain = tmp_path / "in.fasta"
    plain.write_text(FASTA)
    assert read_records(path) == read_records(plain)
    broken = tmp_path / "cut.fasta.gz"
    broken.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(InvalidInputError, match="cut.fasta.gz: not a complete gzip file"):
        read_records(broken)


def test_one_per_line_with_optional_names(tmp_path):
    path = tmp_path / "in.smi"
    path.write_text("CCO ethanol\n\n# comment\nc1ccccc1\n")
    assert read_records(path) == [Record("ethanol", "CCO", 1, 0), Record("line4", "c1ccccc1", 4, 1)]


@pytest.mark.parametrize("separator", [",", "\t"])
def test_tables_by_their_header(tmp_path, separator):
    path = tmp_path / "in.csv"
    rows = [["Entry", "organism", "Sequence"], ["Q1", "human", "MKT AY"], ["", "mouse", "MKV"]]
    path.write_text("\n".join(separator.join(row) for row in rows) + "\n")
    assert read_records(path) == [Record("Q1", "MKTAY", 2, 0), Record("line3", "MKV", 3, 1)]
    chosen = list(iter_records(path, sequence_column="organism", id_column="Sequence"))
    assert [(r.id, r.sequence) for r in chosen] == [("MKT AY", "human"), ("MKV", "mouse")]
    with pytest.raises(InvalidInputError, match="in.csv: line 1 names the columns Entry, organism, Sequence; "
                                                "there is no id column 'accession_id'"):
        list(iter_records(path, id_column="accession_id"))
    short = tmp_path / "short.csv"
    short.write_text("id,sequence\nA,MKT\nB\n")
    with pytest.raises(InvalidInputError, match="short.csv: line 3 has 1 fields"):
        read_records(short)


def test_shards_are_disjoint_cover_the_file_and_keep_positions(tmp_path):
    path = tmp_path / "in.fasta"
    path.write_text("".join(f">r{i}\nMK{'A' * (i % 7)}\n" for i in range(23)))
    every = read_records(path)
    shards = [list(iter_records(path, shard=(i, 4))) for i in range(4)]
    assert sorted(itertools.chain(*shards), key=lambda r: r.index) == every
    assert all(r.index % 4 == i for i, shard in enumerate(shards) for r in shard)
    for bad in [(4, 4), (-1, 2), (0, 0)]:
        with pytest.raises(InvalidInputError, match="give I/N with 0 <= I < N"):
            list(iter_records(path, shard=bad))
    assert parse_shard("2/4") == (2, 4)
    for text in ("2", "a/4", "1/2/3", ""):
        with pytest.raises(InvalidInputError, match="give I/N, e.g. 0/4"):
            parse_shard(text)


def test_not_utf8_names_the_file_and_line(tmp_path):
    path = tmp_path / "in.fasta"
    path.write_bytes(b">a\nMKT\n>b\nMK\xff\n")
    with pytest.raises(InvalidInputError, match=r"in.fasta: not a UTF-8 text file .*near line"):
        read_records(path)


def test_a_large_file_is_read_in_bounded_memory(tmp_path):
    """200,000 records (~26 MB): reading them all one at a time holds a few records, not the file."""
    path = tmp_path / "big.fasta"
    protein = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVHSLAKWKRQTLGQHDFSAGEGLYTHMKALRP"
    with path.open("w") as handle:
        for i in range(200_000):
            handle.write(f">protein{i} some description\n{protein[:60]}\n{protein[60:]}\n")
    assert path.stat().st_size > 25_000_000
    tracemalloc.start()
    try:
        count = sum(1 for _ in iter_records(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 200_000
    assert peak < 2_000_000, f"reading held {peak / 1e6:.1f} MB at its peak"


@pytest.mark.parametrize("name", ["in.fasta", "in.fasta.gz"])
def test_the_read_position_follows_the_file_to_its_end(tmp_path, name):
    """What a job's ETA is made of: the share of the file's bytes read (compressed bytes for .gz),
    rising with the records and 1.0 once the file is read."""
    text = "".join(f">p{i}\n{'MKTAYIAKQR' * 30}\n" for i in range(20_000))
    path = tmp_path / name
    if name.endswith(".gz"):
        with gzip.open(path, "wt", compresslevel=1) as handle:
            handle.write(text)
    else:
        path.write_text(text)
    position = ReadPosition()
    assert position.fraction() == 0.0
    seen = []
    for record in iter_records(path, position=position):
        if record.index % 2_000 == 0:
            seen.append(position.fraction())
    assert seen == sorted(seen) and 0.0 < seen[1] < 0.3 and 0.7 < seen[-1] <= 1.0, seen
    assert position.fraction() == 1.0
