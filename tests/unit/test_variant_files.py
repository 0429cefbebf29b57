"""The files `client score` reads and writes (client/variants.py): ProteinGym-style CSVs of variants,
wild types from FASTA, the scored CSV. The scoring itself is the server's (tests of N_scores)."""

from __future__ import annotations

import csv

import pytest

from bionemo_export.client.records import read_records
from bionemo_export.client.variants import group_by_wild_type, read_variant_table, wild_type_of_rows, write_scored_table


def _csv(path, rows):
    with path.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows(rows)
    return path


def test_a_proteingym_table_is_read_and_written_back_with_a_score_column(tmp_path):
    table = read_variant_table(_csv(tmp_path / "dms.csv", [["mutant", "DMS_score", "note"], ["M1A", "0.5", "a, b"],
                                                           ["K2R:T3S", "-1.2", ""]]))
    assert table.variants() == ["M1A", "K2R:T3S"]
    out = write_scored_table(table, [-0.25, 1.5], tmp_path / "scored.csv", "wt-marginal_score")
    with out.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    assert rows == [["mutant", "DMS_score", "note", "wt-marginal_score"], ["M1A", "0.5", "a, b", "-0.25"],
                    ["K2R:T3S", "-1.2", "", "1.5"]]
    assert not list(tmp_path.glob(".*partial"))
    again = write_scored_table(read_variant_table(out), [1.0, 2.0], tmp_path / "again.csv", "wt-marginal_score")
    assert read_variant_table(again).header.count("wt-marginal_score") == 1  # replaced, not added twice


def test_bad_tables_are_named_with_the_line(tmp_path):
    with pytest.raises(ValueError, match=r"no 'mutant' column \(columns: variant, score\); name it with `column`"):
        read_variant_table(_csv(tmp_path / "a.csv", [["variant", "score"], ["M1A", "1"]]))
    with pytest.raises(ValueError, match=r"b.csv, line 3: 1 cells, the header has 2"):
        read_variant_table(_csv(tmp_path / "b.csv", [["mutant", "score"], ["M1A", "1"], ["K2R"]]))
    with pytest.raises(ValueError, match=r"c.csv, line 2: the 'mutant' cell is empty"):
        read_variant_table(_csv(tmp_path / "c.csv", [["mutant", "score"], [" ", "1"]]))
    (tmp_path / "d.csv").write_bytes(b"mutant\n\xff\xfe\n")
    with pytest.raises(ValueError, match="d.csv: not a UTF-8 text file"):
        read_variant_table(tmp_path / "d.csv")
    (tmp_path / "e.csv").write_text("")
    with pytest.raises(ValueError, match="e.csv: empty"):
        read_variant_table(tmp_path / "e.csv")


def test_rows_find_their_wild_type_in_the_fasta(tmp_path):
    one = tmp_path / "one.fasta"
    one.write_text(">P1 a protein\nMKT\nAY\n")
    table = read_variant_table(_csv(tmp_path / "v.csv", [["mutant", "target"], ["M1A", "P2"], ["K2R", "P1"],
                                                         ["T3S", "P2"]]))
    assert wild_type_of_rows(table, read_records(one), None) == ["MKTAY"] * 3
    two = tmp_path / "two.fasta"
    two.write_text(">P1\nMKTAY\n>P2\nMSLK\n")
    with pytest.raises(ValueError, match="holds 2 sequences: name the .* column .* with `id_column`"):
        wild_type_of_rows(table, read_records(two), None)
    wild_types = wild_type_of_rows(table, read_records(two), "target")
    assert wild_types == ["MSLK", "MKTAY", "MSLK"]
    assert group_by_wild_type(wild_types) == {"MSLK": [0, 2], "MKTAY": [1]}
    with pytest.raises(ValueError, match="no 'gene' column"):
        wild_type_of_rows(table, read_records(two), "gene")
    missing = read_variant_table(_csv(tmp_path / "m.csv", [["mutant", "target"], ["M1A", "P9"]]))
    with pytest.raises(ValueError, match=r"m.csv, line 2: 'P9' is not a record of the FASTA file \(records: P1, P2\)"):
        wild_type_of_rows(missing, read_records(two), "target")


def test_a_table_is_read_and_written_in_chunks_with_its_lines_named(tmp_path):
    import gzip

    from bionemo_export.client.variants import ScoredTableWriter, iter_variant_tables

    rows = [["mutant", "DMS_score"]] + [[f"M1{'ACDEFGHIKL'[i % 10]}", str(i)] for i in range(25)]
    with gzip.open(tmp_path / "dms.csv.gz", "wt", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows(rows)
    chunks = list(iter_variant_tables(tmp_path / "dms.csv.gz", rows=10))
    assert [len(c.rows) for c in chunks] == [10, 10, 5] and [c.first_line for c in chunks] == [2, 12, 22]
    with ScoredTableWriter(tmp_path / "out.csv", chunks[0].header, "score") as writer:
        for chunk in chunks:
            writer.write(chunk, [float(row[1]) / 2 for row in chunk.rows])
    written = list(csv.reader((tmp_path / "out.csv").open(newline="", encoding="utf-8")))
    assert written[0] == ["mutant", "DMS_score", "score"] and written[-1] == ["M1F", "24", "12.0"]
    assert len(written) == 26

    (tmp_path / "wt.fasta").write_text(">a\nMKT\n>b\nMRV\n")
    records = read_records(tmp_path / "wt.fasta")
    bad = _csv(tmp_path / "ids.csv", [["mutant", "id"], *[["M1A", "a"]] * 12, ["M1A", "c"]])
    with pytest.raises(ValueError, match=r"ids.csv, line 14: 'c' is not a record of the FASTA file"):
        for chunk in iter_variant_tables(bad, rows=5):
            wild_type_of_rows(chunk, records, "id")
    with pytest.raises(ValueError, match="no score"), ScoredTableWriter(tmp_path / "failed.csv", ["mutant"], "s"):
        raise ValueError("no score")
    assert not (tmp_path / "failed.csv").exists() and not list(tmp_path.glob(".*partial"))


def test_a_stopped_scored_table_resumes_to_what_one_run_writes(tmp_path):
    """With a fingerprint the writer journals each chunk; a run stopped mid-chunk (half its rows
    written, half a journal line) resumes after the last recorded chunk and ends byte for byte as
    the uninterrupted run; another run's journal is refused, naming what differs."""
    from bionemo_export.client.variants import ScoredTableWriter, iter_variant_tables

    _csv(tmp_path / "dms.csv", [["mutant", "DMS_score"], *[[f"M1{'ACDEFGHIKL'[i % 10]}", str(i)] for i in range(25)]])
    chunks = list(iter_variant_tables(tmp_path / "dms.csv", rows=10))
    run = {"model": "m_scores", "variants": "dms.csv"}

    def scores(chunk):
        return [float(row[1]) / 3 for row in chunk.rows]

    with ScoredTableWriter(tmp_path / "whole.csv", chunks[0].header, "score", dict(run)) as writer:
        for chunk in chunks:
            writer.write(chunk, scores(chunk))
    assert not list(tmp_path.glob(".whole.csv.*"))  # finished: no journal, no temporary file left

    with pytest.raises(KeyboardInterrupt), ScoredTableWriter(tmp_path / "out.csv", chunks[0].header, "score",
                                                             dict(run)) as writer:
        writer.write(chunks[0], scores(chunks[0]))
        writer._handle.write("M1A,10,3.33\nM1C,1")  # the next chunk, cut off by the stop
        writer._handle.flush()
        with writer.journal_path.open("a") as journal:
            journal.write('{"rows": 2')
        raise KeyboardInterrupt
    assert not (tmp_path / "out.csv").exists() and writer.partial.is_file()

    with pytest.raises(ValueError, match=r"journal of another run \(its model differ: model was 'm_scores', now 'x'"), \
            ScoredTableWriter(tmp_path / "out.csv", chunks[0].header, "score", {**run, "model": "x"}):
        pass
    with ScoredTableWriter(tmp_path / "out.csv", chunks[0].header, "score", dict(run)) as again:
        assert again.resumed_rows == 10
        for chunk in chunks:
            if not again.skips(chunk):
                again.write(chunk, scores(chunk))
    assert again.rows == 25
    assert (tmp_path / "out.csv").read_bytes() == (tmp_path / "whole.csv").read_bytes()


def test_an_ensembles_members_scores_get_a_column_each_beside_the_mean(tmp_path):
    """`client score --member-scores`: the mean's column, then `<column>_member1..K`, each added or
    (when the input has it) replaced, one row of scores per table row."""
    from bionemo_export.client.variants import ScoredTableWriter, member_columns

    assert member_columns("score", 3) == ["score_member1", "score_member2", "score_member3"]
    table = read_variant_table(_csv(tmp_path / "dms.csv", [["mutant", "score_member2", "DMS_score"],
                                                           ["M1A", "old", "0.5"], ["K2R", "old", "-1"]]))
    columns = ["score", *member_columns("score", 2)]
    with ScoredTableWriter(tmp_path / "out.csv", table.header, columns) as writer:
        writer.write(table, [[-1.0, -0.5, -1.5], [2.0, 1.0, 3.0]])
        with pytest.raises(ValueError, match=r"scores of shape \[2, 1\] for 2 rows and 3 score columns"):
            writer.write(table, [1.0, 2.0])
    rows = list(csv.reader((tmp_path / "out.csv").open(newline="", encoding="utf-8")))
    assert rows == [["mutant", "score_member2", "DMS_score", "score", "score_member1"],
                    ["M1A", "-1.5", "0.5", "-1.0", "-0.5"], ["K2R", "3.0", "-1", "2.0", "1.0"]]
    with pytest.raises(ValueError, match="give at least one, each once"):
        ScoredTableWriter(tmp_path / "bad.csv", table.header, ["score", "score"])
