"""A bulk job's client memory does not grow with its input: peak RSS of `client encode --output X.h5`
(a child process; its VmHWM, tests/helpers/peak_memory.py) at two input sizes, and per-residue outputs
of thousands of proteins against pooled outputs of three, and at chunk sizes from 32 to 1,200 records.

The server runs stand-in encoders whose answers cost nothing and can be checked
(tests/helpers/tiny_repository.py: length_embeddings, length_hiddens), so the client is what is
measured. benchmarks/job_memory.py runs the same at 10k, 100k and 1M records, and per-residue states of
10,000 proteins from a 1280-wide stand-in at chunk sizes 64, 256 and 1024 (--per-residue)."""

from __future__ import annotations

import gzip
from typing import Any

import h5py
import numpy as np
import pytest

from bionemo_export.client.job_files import read_part
from bionemo_export.runtime import TritonServer
from tests.helpers.peak_memory import cli_peak_rss
from tests.helpers.tiny_repository import length_encoder_repository

AMINO_ACIDS = np.frombuffer(b"ACDEFGHIKLMNPQRSTVWY", dtype="S1")
WIDTH = 32
RSS_BOUND_MB = 300


def _h5(path) -> Any:
    return h5py.File(path, "r")


@pytest.fixture(scope="module")
def server(tmp_path_factory, triton_install):
    work = tmp_path_factory.mktemp("job-memory")
    repo = length_encoder_repository(work / "repo", width=WIDTH)
    with TritonServer(repo, install=triton_install, log_file=work / "server.log") as running:
        yield running


def _fasta(path, count: int, seed: int = 0, longest: int = 400) -> list[str]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(50, longest, size=count)
    letters = AMINO_ACIDS[rng.integers(0, 20, size=int(lengths.sum()))].tobytes().decode("ascii")
    ends = np.cumsum(lengths)
    sequences = [letters[end - length:end] for end, length in zip(ends, lengths, strict=True)]
    with gzip.open(path, "wt", compresslevel=1) as handle:
        handle.write("".join(f">r{i}\n{s}\n" for i, s in enumerate(sequences)))
    return sequences


def _peak_rss_mb(server, model: str, data, out, *options: str) -> float:
    """Run one bulk job as a child process; its peak resident memory in MB."""
    code, output, peak = cli_peak_rss(["client", "encode", "-m", model, "-i", str(data), "--output", str(out),
                                       "--triton-url", f"grpc://{server.endpoints.grpc_url}", *options])
    assert code == 0, output
    return peak


def test_client_memory_does_not_grow_with_the_input(server, tmp_path):
    """Pooled rows of 10,000 and 40,000 records at the default settings: the same peak within 10 %
    (what grows is bounded: a block of duplicate keys, HDF5's caches of the file being merged)."""
    _fasta(tmp_path / "small.fasta.gz", 10_000, seed=1)
    large = _fasta(tmp_path / "large.fasta.gz", 40_000, seed=2)
    rss_small = _peak_rss_mb(server, "length_embeddings", tmp_path / "small.fasta.gz", tmp_path / "small.h5")
    rss_large = _peak_rss_mb(server, "length_embeddings", tmp_path / "large.fasta.gz", tmp_path / "large.h5")
    assert rss_large <= 1.10 * rss_small and rss_large <= RSS_BOUND_MB, (rss_small, rss_large)
    with _h5(tmp_path / "large.h5") as saved:
        embeddings = saved["embeddings"][()]
    assert embeddings.shape == (len(large), WIDTH)
    np.testing.assert_array_equal(embeddings[:, 0], [len(s) for s in large])  # every record, in order
    np.testing.assert_array_equal(embeddings[:, 1], [sum(s.encode()) for s in large])


def test_per_residue_states_cost_a_window_not_their_size(server, tmp_path):
    """Per-residue states of 1,500 and 6,000 proteins (~225 residues x 32 floats each: 41 and
    165 MB): the same peak within 10 %, and far less above a 3-protein pooled job's peak than the
    states would take (what the job holds is a chunk: 256 records here, in requests of 16)."""
    _fasta(tmp_path / "three.fasta.gz", 3, seed=3)
    _fasta(tmp_path / "some.fasta.gz", 1_500, seed=4)
    proteins = _fasta(tmp_path / "many.fasta.gz", 6_000, seed=5)
    window = ["--chunk-size", "256", "--batch-size", "16"]
    pooled = _peak_rss_mb(server, "length_embeddings", tmp_path / "three.fasta.gz", tmp_path / "three.h5", *window)
    some = _peak_rss_mb(server, "length_hiddens", tmp_path / "some.fasta.gz", tmp_path / "some.h5", *window)
    many = _peak_rss_mb(server, "length_hiddens", tmp_path / "many.fasta.gz", tmp_path / "many.h5", *window)
    states_mb = sum(map(len, proteins)) * WIDTH * 4 / 2**20
    assert many <= 1.10 * some and many - pooled < states_mb / 2, (pooled, some, many, states_mb)
    with _h5(tmp_path / "many.h5") as saved:
        ends = saved["embedding_ptr"][()]
        last = saved["embedding"][ends[-2]:ends[-1]]
    assert last.shape == (len(proteins[-1]), WIDTH)  # ragged: the last protein's residues, no padding
    np.testing.assert_array_equal(last[:, 0], list(proteins[-1].encode()))


def test_per_residue_memory_does_not_depend_on_the_chunk_size(server, tmp_path):
    """1,200 proteins of 50-1000 residues, per-residue states in requests of 8: in chunks of 32 and in
    one chunk of 1,200, the same peak within 25 MB. Each record is written as its request is answered,
    cut to its length: a chunk held whole and padded to its longest would be ~150 MB more here."""
    proteins = _fasta(tmp_path / "in.fasta.gz", 1_200, seed=6, longest=1000)
    requests = ["--batch-size", "8", "--in-flight", "4"]
    small = _peak_rss_mb(server, "length_hiddens", tmp_path / "in.fasta.gz", tmp_path / "small", "--chunk-size", "32",
                         *requests)
    large = _peak_rss_mb(server, "length_hiddens", tmp_path / "in.fasta.gz", tmp_path / "large", "--chunk-size",
                         "1200", *requests)
    padded_mb = 1_200 * max(map(len, proteins)) * WIDTH * 4 / 2**20
    assert large - small < 25, (small, large, padded_mb)
    chunk = read_part(tmp_path / "large" / "part-00000.h5")
    assert chunk.residues is not None and [len(r) for r in chunk.residues] == [len(p) for p in proteins]
    np.testing.assert_array_equal(chunk.residues[-1][:, 0], list(proteins[-1].encode()))
