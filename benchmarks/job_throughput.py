"""Is the bulk-job client ever the bottleneck? `client encode --output X.h5` over a FASTA against
perf_analyzer on the same server, the same records, the same batch size and requests in flight.

One server (a tiny random ESM-2 repository built here, Python backend, ONNX Runtime inside; or
--repository), then, interleaved for --rounds rounds:
- perf_analyzer over gRPC at --concurrency C with -b B, its input data the same sequences;
  records/s = its inferences/s x B;
- client encode --batch-size B --in-flight C over the same sequences as FASTA.gz (parsing,
  hashing, duplicates, HDF5 parts, the final file included); records/s = records / wall time.
The issue's target: the client reaches >= 0.95x perf_analyzer's records/s.

    .venv/bin/python benchmarks/job_throughput.py --records 4000 --concurrency 4 --batch-size 8
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bionemo_export import procfs  # noqa: E402
from bionemo_export.runtime import TritonServer, find_perf_analyzer  # noqa: E402

AMINO_ACIDS = np.array(list("ACDEFGHIKLMNPQRSTVWY"))


def sequences(count: int, seed: int = 0) -> list[str]:
    """Distinct random proteins of 30-200 residues (distinct: the client sends each once)."""
    rng = np.random.default_rng(seed)
    return ["".join(AMINO_ACIDS[rng.integers(0, 20, size=int(n))]) for n in rng.integers(30, 200, size=count)]


def build_repository(out: Path) -> Path:
    from bionemo_export.build import BuildRequest, build_repository
    from bionemo_export.model_repository.options import ServingOptions
    from bionemo_export.testing.checkpoints import save_random_checkpoint

    checkpoint = save_random_checkpoint("esm2", out.parent / "checkpoint", seed=0)
    build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="esm2nv", out=out, backend="python",
                                  serving=ServingOptions(max_batch_size=32), optimize=False))
    return out


def perf_analyzer_records_per_s(url: str, model: str, data: Path, concurrency: int, batch: int,
                                window_s: float, work: Path) -> float:
    pa = find_perf_analyzer()
    csv = work / "perf.csv"
    result = pa.run(["-m", model, "-u", url, "-i", "grpc", "-b", str(batch), "--input-data", str(data),
                     "--concurrency-range", str(concurrency), "--measurement-interval", str(int(window_s * 1000)),
                     "--stability-percentage", "50", "--max-trials", "10", "-f", str(csv)], timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    header, row = csv.read_text().splitlines()[:2]
    values = dict(zip(header.split(","), row.split(","), strict=False))
    return float(values["Inferences/Second"])  # perf_analyzer counts inferences as requests x batch size


def client_records_per_s(url: str, model: str, fasta: Path, concurrency: int, batch: int, out: Path) -> float:
    command = [sys.executable, "-m", "bionemo_export.cli.main", "client", "encode", "-m", model, "-i", str(fasta),
               "--output", str(out), "--triton-url", url, "--batch-size", str(batch), "--in-flight",
               str(concurrency)]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"client encode failed:\n{result.stdout}\n{result.stderr[-2000:]}")
    records = int(re.search(r"(\d+) of (\d+) records answered", result.stdout).group(2))  # type: ignore[union-attr]
    return records / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=5.0, help="perf_analyzer measurement window (s)")
    parser.add_argument("--repository", type=Path, help="serve this repository instead of a tiny random ESM-2")
    parser.add_argument("--model", default="esm2nv_embeddings")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "job_throughput.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="job-throughput-") as work:
        work = Path(work)
        repository = args.repository or build_repository(work / "repo")
        proteins = sequences(args.records)
        fasta = work / "in.fasta.gz"
        with gzip.open(fasta, "wt") as handle:
            handle.write("".join(f">p{i}\n{s}\n" for i, s in enumerate(proteins)))
        data = work / "input_data.json"
        data.write_text(json.dumps({"data": [{"sequences": {"content": [s], "shape": [1]}} for s in proteins]}))
        rounds = []
        with TritonServer(repository, log_file=work / "server.log") as server:
            url = server.endpoints.grpc_url
            for number in range(args.rounds):
                pa = perf_analyzer_records_per_s(url, args.model, data, args.concurrency, args.batch_size,
                                                 args.window, work)
                client = client_records_per_s(f"grpc://{url}", args.model, fasta, args.concurrency,
                                              args.batch_size, work / f"out-{number}.h5")
                rounds.append({"perf_analyzer_records_per_s": round(pa, 1), "client_records_per_s": round(client, 1),
                               "ratio": round(client / pa, 3)})
                print(json.dumps(rounds[-1]), flush=True)
    ratios = [r["ratio"] for r in rounds]
    report = {"command": " ".join(["benchmarks/job_throughput.py", *sys.argv[1:]]),
              "machine": f"{procfs.cpu_model() or platform.machine()}, {os.cpu_count()} cores",
              "python": platform.python_version(), "records": args.records, "concurrency": args.concurrency,
              "batch_size": args.batch_size, "rounds": rounds, "median_ratio": float(np.median(ratios)),
              "target": ">= 0.95"}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"median client / perf_analyzer: {report['median_ratio']:.3f}; wrote {args.out}")


if __name__ == "__main__":
    main()
