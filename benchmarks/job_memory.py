"""Bulk-job client memory and speed against input size: `client encode --output X.h5` at its default
settings over 10k, 100k and 1M records, peak RSS of the client process (its VmHWM: tests/helpers/peak_memory.py).

The server runs `length_embeddings` (tests/helpers/tiny_repository.py), a stand-in encoder whose
answers cost nothing, so that the figures are the client's: reading and parsing the FASTA.gz,
hashing, duplicates, requests over gRPC, HDF5 parts, the final merge. What the issue asks: RSS at
10k, 100k and 1M within 10 % of each other, and at most 300 MB at 1M.

    .venv/bin/python benchmarks/job_memory.py --records 10000 100000 1000000
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "job_memory.json")
    args = parser.parse_args()
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
