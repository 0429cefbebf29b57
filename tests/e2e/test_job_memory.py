"""A bulk job's client memory does not grow with its input: peak RSS of `client encode --output X.h5`
(a child process, measured by the kernel: getrusage) at two input sizes, and per-residue outputs
of thousands of proteins against pooled outputs of three.

The server runs stand-in encoders whose answers cost nothing and can be checked
(tests/helpers/tiny_repository.py: length_embeddings, length_hiddens), so the client is what is
measured. benchmarks/job_memory.py runs the same at 10k, 100k and 1M records."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from typing import Any

import h5py
import numpy as np
import pytest

from bionemo_export.runtime import TritonServer
from tests.helpers.tiny_repository import length_encoder_repository

AMINO_ACIDS = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
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


def _fasta(path, count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(50, 400, size=count)
    letters = "".join(AMINO_ACIDS[rng.integers(0, 20, size=int(lengths.sum()))])
    ends = np.cumsum(lengths)
    sequences = [letters[end - length:end] for end, length in zip(ends, lengths, strict=True)]
    with gzip.open(path, "wt", compresslevel=1) as handle:
        handle.write("".join(f">r{i}\n{s}\n" for i, s in enumerate(sequences)))
    return sequences


def _peak_rss_mb(server, model: str, data, out, *options: str) -> float:
    """Run one bulk job as a child process; its peak resident memory in MB."""
    command = [sys.executable, "-m", "bionemo_export.cli.main", "client", "encode", "-m", model, "-i", str(data),
               "--output", str(out), "--triton-url", f"grpc://{server.endpoints.grpc_url}", *options]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.stdout.read() if process.stdout else ""
    _, status, usage = os.wait4(process.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, output
    return usage.ru_maxrss / 1024


def test_client_memory_does_not_grow_with_the_input(server, tmp_path):
    small = _fasta(tmp_path / "small.fasta.gz", 2_000, seed=1)
    large = _fasta(tmp_path / "large.fasta.gz", 40_000, seed=2)
    rss_small = _peak_rss_mb(server, "length_embeddings", tmp_path / "small.fasta.gz", tmp_path / "small.h5")
    rss_large = _peak_rss_mb(server, "length_embeddings", tmp_path / "large.fasta.gz", tmp_path / "large.h5")
    assert rss_large <= 1.10 * rss_small and rss_large <= RSS_BOUND_MB, (rss_small, rss_large)
    with _h5(tmp_path / "large.h5") as saved:
        embeddings = saved["embeddings"][()]
    assert embeddings.shape == (len(large), WIDTH)
    np.testing.assert_array_equal(embeddings[:, 0], [len(s) for s in large])  # every record, in order
    np.testing.assert_array_equal(embeddings[:, 1], [sum(map(ord, s)) for s in large])
    assert len(small) == 2_000


def test_per_residue_states_of_thousands_cost_no_more_than_pooled_rows_of_three(server, tmp_path):
    """The issue's measure: 3,000 proteins' per-residue states (here 3,000 x ~225 residues x 32
    floats: 86 MB) need no more client memory than 3 proteins' pooled rows plus what is in flight
    (a chunk of 256 records: ~7 MB of states, requests of 16)."""
    _fasta(tmp_path / "three.fasta.gz", 3, seed=3)
    proteins = _fasta(tmp_path / "many.fasta.gz", 3_000, seed=4)
    window = ["--chunk-size", "256", "--batch-size", "16"]
    pooled = _peak_rss_mb(server, "length_embeddings", tmp_path / "three.fasta.gz", tmp_path / "three.h5", *window)
    residues = _peak_rss_mb(server, "length_hiddens", tmp_path / "many.fasta.gz", tmp_path / "many.h5", *window)
    total_mb = sum(map(len, proteins)) * WIDTH * 4 / 2**20
    assert total_mb > 80 and residues <= pooled + 40, (pooled, residues, total_mb)
    with _h5(tmp_path / "many.h5") as saved:
        offsets = saved["per_residue/offsets"][()]
        last = saved["per_residue/values"][offsets[-2]:offsets[-1]]
    assert last.shape == (len(proteins[-1]), WIDTH)  # ragged: the last protein's residues, no padding
    np.testing.assert_array_equal(last[:, 0], [ord(letter) for letter in proteins[-1]])
