"""Bulk-job client memory and speed against input size: `client encode --output X.h5` at its default
settings over 10k, 100k and 1M records, peak RSS of the client process (its VmHWM: tests/helpers/peak_memory.py).

The server runs `length_embeddings` (tests/helpers/tiny_repository.py), a stand-in encoder whose
answers cost nothing, so that the figures are the client's: reading and parsing the FASTA.gz,
hashing, duplicates, requests over gRPC, HDF5 parts, the final merge. What the issue asks: RSS at
10k, 100k and 1M within 10 % of each other, and at most 300 MB at 1M.

    .venv/bin/python benchmarks/job_memory.py --records 10000 100000 1000000

`--per-residue` (issue 45): per-residue states of `--records` proteins of 50-1000 residues from a
1280-wide model (the stand-in `length_hiddens`, width 1280: the client receives and stores what a
1280-wide ESM-2 would send, at no cost to the server), stored fp16 in a directory output, at each
of `--chunk-sizes`, in requests of 8 with 4 in flight. The client's peak must not depend on the
chunk size beyond a few MB per record in flight: records are written as their request is
answered, never a chunk held (or padded to its longest) at once. What the peak holds is the
requests in flight (4 x 8 records, each up to 1000 x 1280 fp32 values as received and as read:
~10 MB a record), so chunk sizes are compared from 32 records up (a smaller chunk has fewer
requests in flight: at 16, 2; measured here at 120 proteins: 412-452 MB at chunk 16, 465-522 at
32 and 120 alike). 10,000 such proteins are 5.3M
residues: 27 GB sent as fp32, 13 GB written per chunk size (removed after each run).

    .venv/bin/python benchmarks/job_memory.py --per-residue --records 10000 --chunk-sizes 64 256 1024
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bionemo_export import procfs  # noqa: E402
from bionemo_export.runtime import TritonServer  # noqa: E402
from tests.helpers.peak_memory import cli_peak_rss  # noqa: E402
from tests.helpers.tiny_repository import length_encoder_repository  # noqa: E402

AMINO_ACIDS = np.frombuffer(b"ACDEFGHIKLMNPQRSTVWY", dtype="S1")
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "job_memory.json"
WIDTH = 1280
"""The per-residue benchmark's hidden size: ESM-2 650M's."""
BATCH = 8
"""Rows a request in the per-residue benchmark: 8 x 1000 residues x 1280 floats = 41 MB at most."""


def write_fasta(path: Path, count: int, seed: int = 0) -> None:
    """`count` proteins of 50-400 residues (one in 20 a repeat of an earlier one), gzipped."""
    rng = np.random.default_rng(seed)
    block = 10_000
    with gzip.open(path, "wt", compresslevel=1) as handle:
        for start in range(0, count, block):
            n = min(block, count - start)
            lengths = rng.integers(50, 400, size=n)
            text = AMINO_ACIDS[rng.integers(0, 20, size=int(lengths.sum()))].tobytes().decode("ascii")
            ends = np.cumsum(lengths)
            lines = []
            for i in range(n):
                sequence = text[ends[i] - lengths[i]:ends[i]]
                if i % 20 == 19:
                    sequence = text[:lengths[0]]  # a repeat: sent once
                lines.append(f">r{start + i} synthetic\n{sequence}\n")
            handle.write("".join(lines))


def run_job(url: str, data: Path, out: Path) -> dict:
    """One `client encode` bulk job as a child process: its seconds and peak RSS (VmHWM)."""
    start = time.perf_counter()
    code, output, peak = cli_peak_rss(["client", "encode", "-m", "length_embeddings", "-i", str(data),
                                       "--output", str(out), "--triton-url", url])
    seconds = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"client encode failed: {output}")
    return {"seconds": round(seconds, 1), "peak_rss_mb": round(peak, 1), "summary": output.strip()}


def write_proteins(path: Path, count: int, seed: int = 0) -> int:
    """`count` proteins of 50-1000 residues (uniform), gzipped; their residues in all."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(50, 1001, size=count)
    with gzip.open(path, "wt", compresslevel=1) as handle:
        for start in range(0, count, 1000):
            block = lengths[start:start + 1000]
            text = AMINO_ACIDS[rng.integers(0, 20, size=int(block.sum()))].tobytes().decode("ascii")
            ends = np.cumsum(block)
            handle.write("".join(f">p{start + i}\n{text[ends[i] - n:ends[i]]}\n" for i, n in enumerate(block)))
    return int(lengths.sum())


def per_residue(records: int, chunk_sizes: list[int], out: Path) -> None:
    """Peak client RSS of per-residue jobs at each chunk size (see the module's docstring)."""
    results = []
    with tempfile.TemporaryDirectory(prefix="job-memory-residues-") as work:
        work = Path(work)
        repo = length_encoder_repository(work / "repo", width=WIDTH, max_batch_size=BATCH)
        data = work / "proteins.fasta.gz"
        residues = write_proteins(data, records)
        with TritonServer(repo, log_file=work / "server.log") as server:
            url = f"grpc://{server.endpoints.grpc_url}"
            for chunk_size in chunk_sizes:
                target = work / f"out-{chunk_size}"
                start = time.perf_counter()
                code, output, peak = cli_peak_rss(["client", "encode", "-m", "length_hiddens", "-i", str(data),
                                                   "--output", str(target), "--triton-url", url, "--precision",
                                                   "fp16", "--chunk-size", str(chunk_size), "--batch-size",
                                                   str(BATCH), "--in-flight", "4"])
                seconds = time.perf_counter() - start
                if code != 0:
                    raise RuntimeError(f"client encode failed: {output}")
                written = sum(path.stat().st_size for path in target.iterdir())
                result = {"chunk_size": chunk_size, "peak_rss_mb": round(peak, 1), "seconds": round(seconds, 1),
                          "written_gb": round(written / 1e9, 2), "summary": " ".join(output.split())}
                print(json.dumps(result), flush=True)
                results.append(result)
                shutil.rmtree(target)
    padded_chunk_mb = {size: round(size * 1000 * WIDTH * 4 / 2**20) for size in chunk_sizes}
    report = {"command": " ".join(["benchmarks/job_memory.py", "--per-residue", "--records", str(records),
                                   "--chunk-sizes", *map(str, chunk_sizes)]),
              "machine": f"{procfs.cpu_model() or platform.machine()}, {os.cpu_count()} cores",
              "python": platform.python_version(), "numpy": np.__version__, "h5py": _version("h5py"),
              "tritonclient": _version("tritonclient"),
              "workload": {"records": records, "residues": residues, "lengths": "50-1000 uniform", "width": WIDTH,
                           "precision": "fp16", "batch_size": BATCH, "in_flight": 4,
                           "model": "length_hiddens (tests/helpers/tiny_repository.py), width 1280"},
              "what_a_chunk_padded_to_1000_residues_in_fp32_would_hold_mb": padded_chunk_mb,
              "results": results}
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--per-residue", action="store_true",
                        help="per-residue states of 1280-wide answers at each of --chunk-sizes (issue 45)")
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[64, 256, 1024])
    args = parser.parse_args()
    if args.per_residue:
        out = args.out if args.out != DEFAULT_OUT else ROOT / "benchmarks" / "results" / "job_memory_per_residue.json"
        per_residue(args.records[0], args.chunk_sizes, out)
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="job-memory-") as work:
        work = Path(work)
        repo = length_encoder_repository(work / "repo")
        with TritonServer(repo, log_file=work / "server.log") as server:
            url = f"grpc://{server.endpoints.grpc_url}"
            for count in args.records:
                data = work / f"in-{count}.fasta.gz"
                write_fasta(data, count)
                result = {"records": count, **run_job(url, data, work / f"out-{count}.h5")}
                result["records_per_s"] = round(count / result["seconds"], 1)
                print(json.dumps(result), flush=True)
                results.append(result)
                data.unlink()
    report = {"command": " ".join(["benchmarks/job_memory.py", "--records", *map(str, args.records)]),
              "machine": f"{procfs.cpu_model() or platform.machine()}, {os.cpu_count()} cores",
              "python": platform.python_version(), "results": results}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
