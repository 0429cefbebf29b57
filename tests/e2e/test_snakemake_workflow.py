"""The shipped Snakemake workflow (workflows/encode/Snakefile) run for real by `snakemake --cores 2`
against a real tritonserver: two shards of one bulk job, one shard's `client encode` process killed
with SIGKILL mid-run, Snakemake's retry resuming it, and `client merge` writing what the job run
unsharded writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from bionemo_export.client.job_files import JOURNAL
from bionemo_export.runtime import TritonServer
from tests.e2e.test_encode_jobs import _dataset, _h5

ROOT = Path(__file__).resolve().parents[2]
SNAKEFILE = ROOT / "workflows" / "encode" / "Snakefile"
BIN = Path(sys.executable).parent
"""The environment's scripts: `snakemake` and the `bionemo-export` the workflow's commands run."""
# Small requests, one at a time: a shard then takes a few seconds, long enough to be killed mid-run.
SLOW = ["--batch-size", "2", "--in-flight", "1"]


@pytest.fixture(scope="module")
def server(esm2_repository, tmp_path_factory, triton_install):
    work = tmp_path_factory.mktemp("snakemake")
    with TritonServer(esm2_repository, install=triton_install, log_file=work / "server.log") as running:
        yield running


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def _parts_recorded(journal: Path) -> int:
    """The parts a job's journal records as written (its other lines: the fingerprint, notes)."""
    if not journal.exists():
        return 0
    return sum('"part"' in line for line in journal.read_text().splitlines())


def _encode_process(work: Path, shard_folder: str) -> psutil.Process | None:
    """The running `bionemo-export client encode` started in `work` whose --output is `shard_folder`."""
    for process in psutil.process_iter(["cmdline", "cwd"]):
        command = process.info["cmdline"] or []
        if ("encode" in command and "--output" in command and process.info["cwd"] == str(work)
                and command[command.index("--output") + 1:][:1] == [shard_folder]):
            return process
    return None


def _snakemake(work: Path, config: Path, log: Path) -> subprocess.Popen:
    """snakemake on the shipped workflow in `work`, its output in `log` (a pipe left unread would
    fill and stall it while the test waits)."""
    with log.open("a") as out:
        return subprocess.Popen([str(BIN / "snakemake"), "--cores", "2", "--snakefile", str(SNAKEFILE),
                                 "--configfile", str(config), "--directory", str(work)],
                                cwd=work, env=_env(), stdout=out, stderr=subprocess.STDOUT, text=True)


def test_snakemake_retries_a_killed_shard_and_merges_the_shards_into_the_unsharded_output(server, tmp_path):
    url = f"grpc://{server.endpoints.grpc_url}"
    _dataset(tmp_path / "in.fasta.gz", 200, seed=21)
    whole = subprocess.run([str(BIN / "bionemo-export"), "client", "encode", "-m", "esm2nv_embeddings", "-i",
                            str(tmp_path / "in.fasta.gz"), "--output", str(tmp_path / "whole.h5"), "--chunk-size", "8",
                            "--triton-url", url, *SLOW], env=_env(), capture_output=True, text=True, timeout=300)
    assert whole.returncode == 3, whole.stdout + whole.stderr  # partial: the one bad record

    # JSON is YAML: the config a user writes (workflows/encode/config.example.yaml), relative paths.
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"model": "esm2nv_embeddings", "input": "in.fasta.gz", "output": "merged.h5",
                                  "n_shards": 2, "triton_urls": [url], "chunk_size": 8, "retries": 2,
                                  "extra_args": SLOW}))
    log = tmp_path / "snakemake.log"
    workflow = _snakemake(tmp_path, config, log)
    shard = "merged.h5.shards/shard-0"
    deadline = time.monotonic() + 120
    # Killed once its journal records a part: a retry has something to resume.
    while _parts_recorded(tmp_path / shard / JOURNAL) < 1 and workflow.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    victim = _encode_process(tmp_path, shard)
    assert victim is not None, log.read_text()
    victim.send_signal(signal.SIGKILL)
    assert workflow.wait(timeout=240) == 0, log.read_text()

    ran = log.read_text()
    assert "Trying to restart job" in ran, ran  # Snakemake's retry, not a shard that finished before its kill
    marker = " ".join((tmp_path / "merged.h5.shards" / "shard-0.done").read_text().split())  # unwrapped
    assert "resumed after" in marker, marker  # the retry took up the killed run's parts
    assert "merged 2 shards: 199 of 200 records answered" in ran, ran
    with _h5(tmp_path / "whole.h5") as a, _h5(tmp_path / "merged.h5") as b:
        for name in ("ids", "index", "sequence_sha256"):
            np.testing.assert_array_equal(b[name][()], a[name][()], err_msg=name)
        # A shard's records share requests with other records than in the unsharded run (padded to
        # another longest sequence): float rounding, a few 1e-7 here, no more.
        np.testing.assert_allclose(b["embeddings"][()], a["embeddings"][()], rtol=0, atol=1e-6)
        assert json.loads(b.attrs["fingerprint"]) == json.loads(a.attrs["fingerprint"])
    assert (tmp_path / "merged.h5.errors.tsv").read_text() == (tmp_path / "whole.h5.errors.tsv").read_text()

    # Run again: every output is there and up to date, nothing runs.
    again = _snakemake(tmp_path, config, tmp_path / "again.log")
    assert again.wait(timeout=120) == 0 and "Nothing to be done" in (tmp_path / "again.log").read_text()
