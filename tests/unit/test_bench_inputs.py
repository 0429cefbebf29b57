"""`bionemo-export bench` without a server: input generation (lengths, FASTA/SMILES files,
perf_analyzer JSON), server statistics arithmetic and the report files (one end-to-end run of the
real perf_analyzer: tests/e2e/test_bench.py)."""


from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from bionemo_export.bench import (
    BenchResult,
    ConcurrencyResult,
    InputError,
    InputSpec,
    LengthDistribution,
    ModelStats,
    Target,
    generate_inputs,
    random_proteins,
    read_sequences,
    write_report,
)
from bionemo_export.bench.inputs import STANDARD_AMINO_ACIDS
from bionemo_export.bench.run import primary_batch_model, repository_max_residues, statistics_delta
from bionemo_export.cli.main import error_line
from bionemo_export.tensors import DType, TensorSpec

SEQUENCES = [TensorSpec("sequences", DType.BYTES, (1,))]
HIDDENS = [TensorSpec("hiddens", DType.FP32, (-1, 16)), TensorSpec("mask", DType.BOOL, (-1,))]


@pytest.mark.parametrize(("spec", "low", "high"), [
    ("antibody", 110, 130), ("uniform:50-1000", 50, 1000), ("fixed:64", 64, 64), ("uniprot", 30, 1000),
    ("smiles", 10, 120), ("lognormal:100,0.5,20-400", 20, 400),
])
def test_lengths_stay_within_the_distribution_bounds(spec, low, high):
    lengths = LengthDistribution.parse(spec).sample(4000, np.random.default_rng(0))
    assert lengths.dtype == np.int64 and len(lengths) == 4000
    assert lengths.min() >= low and lengths.max() <= high
    if low != high:
        assert lengths.min() < low + (high - low) * 0.2 and lengths.max() > high - (high - low) * 0.6


def test_uniprot_default_is_log_normal_around_300_residues():
    lengths = LengthDistribution.parse("uniprot").sample(20000, np.random.default_rng(1))
    assert 280 <= np.median(lengths) <= 320
    assert 330 <= lengths.mean() <= 390  # Swiss-Prot's mean is ~360
    assert (lengths > 800).mean() < 0.1


def test_uniform_lengths_are_uniform_and_seeded():
    a = LengthDistribution.parse("uniform:50-1000").sample(20000, np.random.default_rng(7))
    b = LengthDistribution.parse("uniform:50-1000").sample(20000, np.random.default_rng(7))
    np.testing.assert_array_equal(a, b)
    assert abs(a.mean() - 525) < 10
    counts, _ = np.histogram(a, bins=5, range=(50, 1001))
    assert counts.min() > 0.9 * counts.max()


def test_lengths_are_clipped_to_the_model_maximum():
    lengths = LengthDistribution.parse("uniform:50-1000").sample(1000, np.random.default_rng(0), max_length=200)
    assert lengths.max() == 200 and lengths.min() >= 50


@pytest.mark.parametrize("spec", ["poisson:3", "uniform:10", "uniform:30-10", "fixed:0", "lognormal:x,1", ""])
def test_bad_length_distributions_are_refused(spec):
    with pytest.raises(InputError, match="distribution"):
        LengthDistribution.parse(spec)


def test_random_proteins_use_the_20_standard_residues_with_natural_frequencies():
    rng = np.random.default_rng(0)
    proteins = random_proteins(np.array([5, 50, 500, 5000]), rng)
    assert [len(p) for p in proteins] == [5, 50, 500, 5000]
    text = "".join(proteins)
    assert set(text) <= set(STANDARD_AMINO_ACIDS) and len(set(text)) == 20
    assert text.count("L") > text.count("W") * 4  # leucine ~9.7%, tryptophan ~1.1%


def test_fasta_records_span_lines_and_are_normalized(tmp_path):
    path = tmp_path / "in.fasta"
    path.write_text(">sp|P1|ONE first protein\nMKTAY\nIAKQR*\n\n>two\nmslkrk\n;comment\nNIAL\n")
    assert read_sequences(path) == [("sp|P1|ONE", "MKTAYIAKQR"), ("two", "MSLKRKNIAL")]


def test_bad_fasta_records_are_reported_by_id(tmp_path):
    path = tmp_path / "bad.fasta"
    path.write_text("MKT\n>good\nMKTAY\n>empty\n>gapped\nMK-TAY\n>digits\nMK1TAY\n>good2\nACDE\n")
    with pytest.raises(InputError) as err:
        read_sequences(path)
    message = str(err.value)
    assert "4 bad record(s)" in message
    assert "empty: empty sequence" in message
    assert "gapped: invalid character(s) '-'" in message
    assert "digits: invalid character(s) '1'" in message
    assert "before the first '>' header" in message
    assert "good:" not in message and "good2" not in message


def test_one_sequence_per_line_files_skip_blanks_and_comments(tmp_path):
    path = tmp_path / "mols.smi"
    path.write_text("# SMILES name\nCCO ethanol\n\nc1ccccc1O\n")
    assert read_sequences(path) == [("ethanol", "CCO"), ("line 4", "c1ccccc1O")]


@pytest.mark.parametrize(("content", "message"), [(b"", "no sequences"), (b">x\nMK\xff\n", "not UTF-8")])
def test_unreadable_files_are_refused(tmp_path, content, message):
    path = tmp_path / "in.fa"
    path.write_bytes(content)
    with pytest.raises(InputError, match=message):
        read_sequences(path)


def test_sequences_json_is_perf_analyzers_documented_format(tmp_path):
    data = generate_inputs(SEQUENCES, InputSpec(lengths="antibody", count=16, seed=3))
    written = json.loads(data.write(tmp_path / "input.json").read_text())
    assert list(written) == ["data"] and len(written["data"]) == 16
    for entry, length in zip(written["data"], data.lengths):
        assert list(entry) == ["sequences"]
        assert entry["sequences"]["shape"] == [1]
        (sequence,) = entry["sequences"]["content"]
        assert isinstance(sequence, str) and len(sequence) == length and 110 <= length <= 130
    assert data.mean_length == pytest.approx(np.mean(data.lengths))
    # Seeded: the same spec gives the same sequences (so compared targets get the same inputs).
    assert generate_inputs(SEQUENCES, InputSpec(lengths="antibody", count=16, seed=3)).entries == data.entries
    assert generate_inputs(SEQUENCES, InputSpec(lengths="antibody", count=16, seed=4)).entries != data.entries


def test_sequences_from_a_file_and_the_model_limit(tmp_path):
    path = tmp_path / "in.fasta"
    path.write_text(">a\nMKTAY\n>b\nMKTAYIAKQR\n")
    data = generate_inputs(SEQUENCES, InputSpec(file=path))
    assert [e["sequences"]["content"] for e in data.entries] == [["MKTAY"], ["MKTAYIAKQR"]]
    assert data.lengths == [5, 10]
    with pytest.raises(InputError, match="longer than the model's 8: b"):
        generate_inputs(SEQUENCES, InputSpec(file=path, max_length=8))


def test_hiddens_json_has_b64_float32_and_a_full_mask():
    data = generate_inputs(HIDDENS, InputSpec(lengths="uniform:5-9", count=4, seed=0))
    assert data.kind == "hiddens"
    for entry, length in zip(data.entries, data.lengths):
        hiddens = entry["hiddens"]
        assert hiddens["shape"] == [length, 16]
        values = np.frombuffer(base64.b64decode(hiddens["content"]["b64"]), dtype="<f4")
        assert values.size == length * 16 and np.isfinite(values).all() and 0.5 < values.std() < 1.5
        assert entry["mask"] == {"content": [True] * length, "shape": [length]}
    json.dumps(data.to_json())  # serializable as is


def test_optional_inputs_are_left_out_and_unsupported_inputs_refused():
    data = generate_inputs([*SEQUENCES, TensorSpec("num_samples", DType.INT32, (1,), optional=True)],
                           InputSpec(lengths="fixed:10", count=2))
    assert list(data.entries[0]) == ["sequences"] and "num_samples" in data.notes[0]
    with pytest.raises(InputError, match="cannot generate inputs.*input_ids INT64"):
        generate_inputs([TensorSpec("input_ids", DType.INT64, (-1,))], InputSpec())
    with pytest.raises(InputError, match="`file` gives sequences.*use `lengths`") as hiddens:
        generate_inputs(HIDDENS, InputSpec(file=Path(__file__)))
    # The library names InputSpec's fields; the command line words them as bench's flags.
    assert error_line(hiddens.value).startswith("error: --input gives sequences")
    assert error_line(hiddens.value).endswith("(hidden states): use --lengths")


def test_targets_are_folders_or_urls(tmp_path):
    assert Target.parse(str(tmp_path), "m").repository == tmp_path.resolve()
    url = Target.parse("http://127.0.0.1:8000/", "m")
    assert (url.protocol, url.url, url.where) == ("http", "127.0.0.1:8000", "http://127.0.0.1:8000")
    assert Target.parse("localhost:8001", "m", protocol="grpc").where == "grpc://localhost:8001"
    with pytest.raises(ValueError):
        Target.parse("ftp://x:1", "m")
    with pytest.raises(ValueError):
        Target.parse(str(tmp_path / "missing"), "m")


def _counters(inferences, executions, queue_ns=0):
    return {"inferences": inferences, "executions": executions, "requests": inferences, "failures": 0,
            "queue_ns": queue_ns, "compute_ns": 1000 * inferences}


def test_server_batch_size_comes_from_counter_differences_and_prefers_the_encoder():
    before = {"n_embeddings": _counters(10, 10), "n_tokenizer": _counters(10, 10), "n_encoder": _counters(10, 10),
              "n_hiddens": _counters(5, 5)}
    after = {"n_embeddings": _counters(110, 110), "n_tokenizer": _counters(110, 60),
             "n_encoder": _counters(110, 35, queue_ns=200_000), "n_hiddens": _counters(5, 5)}
    ran = statistics_delta(before, after)
    assert {m.name for m in ran} == {"n_embeddings", "n_tokenizer", "n_encoder"}  # n_hiddens was idle
    encoder = primary_batch_model("n_embeddings", ["n_tokenizer", "n_encoder"], ran)
    assert encoder is not None and encoder.name == "n_encoder" and encoder.batch_size == pytest.approx(4.0)
    assert encoder.queue_us == pytest.approx(2.0)
    plain = primary_batch_model("n_decodes", [], [ModelStats("n_decodes", 30, 10, 30, 0, 1.0, 2.0)])
    assert plain is not None and plain.batch_size == pytest.approx(3.0)


def test_repository_max_residues_reads_the_character_tokenizer(tmp_path):
    version = tmp_path / "n_tokenizer" / "1"
    version.mkdir(parents=True)
    (version / "tokenizer.json").write_text(json.dumps(
        {"residues": "ACD", "max_length": 1024, "bos_token": "<cls>", "eos_token": "<eos>"}))
    assert repository_max_residues(tmp_path, ["n_embeddings", "n_tokenizer"]) == 1022
    assert repository_max_residues(tmp_path, ["n_embeddings"]) is None


def _fake_result(label, scale):
    results = [
        ConcurrencyResult(c, 10.0 * c * scale, 1000.0 * c * scale, 5.0 * c, 6.0 * c, 7.0 * c, 8.0 * c,
                          1.5, "n_encoder", [ModelStats("n_encoder", 30, 20, 30, 0, 10.0, 20.0)], c != 8,
                          f"perf_{label}_c{c}.csv", 1.0)
        for c in (1, 8)
    ]
    return BenchResult(label, f"/repo/{label}", "n_embeddings", "grpc", "2.51.0", "2.51.0", "random proteins",
                       [], 120.0, 16, 5.0, results)


def test_report_files_and_ratios(tmp_path):
    a, b = _fake_result("A", 1.0), _fake_result("B", 2.0)
    paths = write_report([a, b], tmp_path, command="bionemo-export bench x", env={"platform": "test", "cores": 2})
    report = paths["report"].read_text()
    assert "bionemo-export bench x" in report and "## Comparison B / A" in report and "2.00x" in report
    assert "| 8 * |" in report  # the unstable run is marked
    document = json.loads(paths["json"].read_text())
    assert document["comparison"][1]["throughput_ratio"] == pytest.approx(2.0)
    assert document["targets"][0]["results"][0]["models"][0]["batch_size"] == 1.5
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_scores_model_gets_random_single_substitutions_of_each_sequence():
    """N_scores (tasks.py): `variants` is optional; bench sends --variants of them per request,
    each a valid substitution of its own sequence, and leaves `method` to its default."""
    import re

    scores = [TensorSpec("sequences", DType.BYTES, (1,)), TensorSpec("variants", DType.BYTES, (-1,), optional=True),
              TensorSpec("method", DType.BYTES, (1,), optional=True)]
    data = generate_inputs(scores, InputSpec(lengths="uniform:20-40", count=8, seed=1, variants=5))
    for entry in data.entries:
        sequence = entry["sequences"]["content"][0]
        variants = entry["variants"]["content"]
        assert entry["variants"]["shape"] == [5] and len(variants) == 5 and "method" not in entry
        for variant in variants:
            substitution = re.fullmatch(r"([A-Z])(\d+)([A-Z])", variant)
            assert substitution, variant
            wild, position, mutant = substitution.groups()
            assert sequence[int(position) - 1] == wild != mutant
    assert data.notes == ["optional input(s) left out: method"] and "5 random single substitutions" in data.description
    plain = generate_inputs(scores, InputSpec(lengths="uniform:20-40", count=2, variants=0))
    assert "variants" not in plain.entries[0] and plain.notes == ["optional input(s) left out: variants, method"]


def test_layers_models_get_the_layers_and_poolings_asked_in_every_request():
    """N_layers (tasks.py): `layers` and `include` are optional; bench sends --layers and --include
    in every request, and leaves them out (the server's defaults) when not given."""
    from bionemo_export.tasks import TASKS

    inputs = list(TASKS["layers"].inputs)
    data = generate_inputs(inputs, InputSpec(lengths="uniform:20-40", count=4, seed=1, layers=(0, -1),
                                             include=("mean", "max")))
    for entry in data.entries:
        assert entry["layers"] == {"content": [0, -1], "shape": [2]}
        assert entry["include"] == {"content": ["mean", "max"], "shape": [2]}
    assert "layers 0,-1; include mean,max" in data.description and not data.notes
    plain = generate_inputs(inputs, InputSpec(lengths="uniform:20-40", count=4, seed=1))
    assert "layers" not in plain.entries[0] and plain.notes == ["optional input(s) left out: layers, include"]


def test_attentions_models_get_the_blocks_and_heads_asked_in_every_request():
    """N_attentions (tasks.py): `layers` (blocks) and `heads` are optional; bench sends --layers and
    --heads in every request, and leaves them out when not given."""
    from bionemo_export.tasks import TASKS

    inputs = list(TASKS["attentions"].inputs)
    data = generate_inputs(inputs, InputSpec(lengths="uniform:20-40", count=3, seed=1, layers=(-1,), heads=(0, 2),
                                             include=("mean",)))
    for entry in data.entries:
        assert entry["layers"] == {"content": [-1], "shape": [1]}
        assert entry["heads"] == {"content": [0, 2], "shape": [2]}
        assert "include" not in entry  # not an input of N_attentions
    assert "layers -1; heads 0,2" in data.description and not data.notes
    plain = generate_inputs(inputs, InputSpec(lengths="uniform:20-40", count=3, seed=1))
    assert plain.notes == ["optional input(s) left out: layers, heads"]
