"""Exactly once under faults (issue 28): a bulk job whose client is killed with SIGKILL at --kills
random points, and one of its two servers killed with SIGKILL mid-run, against the same job run
without faults. Zero records lost, zero duplicated, the same rows in the same order, the same
errors file.

Two tritonservers serve a tiny random ESM-2 repository; the job (`client encode --output X.h5
--triton-url A --triton-url B`) is started again after each client kill, until one run ends. The
first server is killed (SIGKILL, not a clean stop) once a third of the parts are written.

    .venv/bin/python benchmarks/job_faults.py --records 2000 --kills 20
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.job_throughput import build_repository  # noqa: E402
from bionemo_export import procfs  # noqa: E402
from bionemo_export.client.job_files import JOURNAL  # noqa: E402
from bionemo_export.runtime import TritonServer  # noqa: E402
from tests.helpers.job_inputs import write_proteins  # noqa: E402


def dataset(path: Path, count: int, seed: int = 0) -> None:
    """`count` proteins of 5-119 residues, one in 17 a repeat, one with a character ESM-2 refuses."""
    write_proteins(path, count, seed, longest=120)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "job_faults.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="job-faults-") as work:
        work = Path(work)
        repository = build_repository(work / "repo")
        dataset(work / "in.fasta.gz", args.records)
        chunk = max(4, args.records // (5 * args.kills))  # enough parts for every kill to land mid-run
        with TritonServer(repository, log_file=work / "a.log") as first, \
                TritonServer(repository, log_file=work / "b.log") as second:
            urls = [f"grpc://{first.endpoints.grpc_url}", f"grpc://{second.endpoints.grpc_url}"]
            base = [sys.executable, "-m", "bionemo_export.cli.main", "client", "encode", "-m", "esm2nv_embeddings",
                    "-i", str(work / "in.fasta.gz"), "--chunk-size", str(chunk), "--batch-size", "4",
                    "--in-flight", "1"]
            whole = subprocess.run([*base, "--output", str(work / "whole.h5"), "--triton-url", urls[1]],
                                   capture_output=True, text=True)
            assert whole.returncode == 3, whole.stdout + whole.stderr
            parts_total = -(-args.records // chunk)
            journal = work / "faulty.h5.parts" / JOURNAL
            command = [*base, "--output", str(work / "faulty.h5"), "--triton-url", urls[0], "--triton-url", urls[1]]
            kills, server_killed, started = 0, 0, time.perf_counter()
            while True:
                process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                before = lines(journal)
                deadline = time.monotonic() + 120
                while process.poll() is None and lines(journal) <= before and time.monotonic() < deadline:
                    if not server_killed and lines(journal) > parts_total // 3 and first.pid is not None:
                        os.kill(first.pid, signal.SIGKILL)  # the server, not cleanly: its requests move
                        server_killed = lines(journal) - 1
                    time.sleep(0.01)
                time.sleep(float(rng.uniform(0.0, 0.1)))
                if process.poll() is not None or kills >= args.kills:
                    output, _ = process.communicate(timeout=600)
                    break
                process.send_signal(signal.SIGKILL)
                process.wait()
                kills += 1
            seconds = time.perf_counter() - started
        assert process.returncode == 3, output
        a: Any
        b: Any
        with h5py.File(work / "whole.h5") as a, h5py.File(work / "faulty.h5") as b:
            ids_a, ids_b = a["ids"][()].tolist(), b["ids"][()].tolist()
            same_values = bool(np.allclose(b["embeddings"][()], a["embeddings"][()], atol=1e-5))
            moved = json.loads(b.attrs["summary"])["moved"]
        result = {
            "records": args.records, "parts": parts_total, "client_kills": kills,
            "server_killed_after_parts": server_killed,
            "lost": len(set(ids_a) - set(ids_b)), "duplicated": len(ids_b) - len(set(ids_b)),
            "same_order": ids_a == ids_b, "same_values_atol_1e-5": same_values, "requests_moved": moved,
            "same_errors_file": ((work / "whole.h5.errors.tsv").read_text()
                                 == (work / "faulty.h5.errors.tsv").read_text()),
            "seconds": round(seconds, 1), "final_run": output.strip().replace("\n", " "),
        }
    report = {"command": " ".join(["benchmarks/job_faults.py", *sys.argv[1:]]),
              "machine": f"{procfs.cpu_model() or 'x86_64'}, {os.cpu_count()} cores", **result}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
