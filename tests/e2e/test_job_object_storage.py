"""Bulk jobs whose output is in object storage (runtime/job_storage.py, runtime/job_lease.py), with a
local S3-compatible server (moto) and, for whole runs, a real tritonserver serving the tiny ESM-2
repository: a run stopped during its last uploads is completed by the next run, checked by digest,
the marker of completeness last; one run at a time holds an output (a lease object that expires
unless renewed); and the job's local folder is private to the user."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import socket
import stat
import subprocess
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from bionemo_export.cli.main import app
from bionemo_export.client.job_files import MANIFEST
from bionemo_export.client.job_lock import JobLockedError
from bionemo_export.runtime import TritonServer
from bionemo_export.runtime.job_lease import _machine
from bionemo_export.runtime.job_storage import JOBS_DIR_ENV, LEASE, OutputMirror, local_folder
from tests.helpers.object_store import local_s3

runner = CliRunner()
BUCKET = "jobs"
AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"


@pytest.fixture(scope="module")
def server(esm2_repository, tmp_path_factory, triton_install):
    work = tmp_path_factory.mktemp("s3-jobs")
    with TritonServer(esm2_repository, install=triton_install, log_file=work / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def s3():
    """(a boto3 client of the local store, the s3:// location of its bucket as the CLI takes it)."""
    import boto3

    with local_s3(BUCKET) as endpoint:
        yield boto3.client("s3", endpoint_url=endpoint), f"s3://{endpoint.removeprefix('http://')}/{BUCKET}"


def _dataset(path: Path, count: int) -> Path:
    """A gzipped FASTA of `count` proteins, one with a character ESM-2 refuses (an errors file)."""
    rng = np.random.default_rng(3)
    records = [(f"p{i:03d}", "".join(rng.choice(list(AMINO_ACIDS), size=int(n))))
               for i, n in enumerate(rng.integers(5, 40, size=count))]
    records[count // 2] = ("bad_char", "MKTJAK")
    with gzip.open(path, "wt") as handle:
        handle.write("".join(f">{i}\n{s}\n" for i, s in records))
    return path


def _encode(server, input: Path, output: str) -> list[str]:
    return ["client", "encode", "-m", "esm2nv_embeddings", "-i", str(input), "--output", output, "--chunk-size", "8",
            "--batch-size", "4", "--in-flight", "1", "--triton-url", f"grpc://{server.endpoints.grpc_url}"]


def _stored(client, prefix: str) -> dict[str, str]:
    """name (relative to `prefix`) -> SHA-256 of the bytes of every object under `prefix`."""
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {item["Key"][len(prefix):]: hashlib.sha256(client.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read())
            .hexdigest() for item in listed}


def _said(text: str) -> str:
    """Text without its white space: rich wraps long lines (paths) anywhere."""
    return "".join(text.split())


def _local(folder: Path, names: list[str]) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in names}


def test_a_rerun_uploads_what_a_stopped_upload_left_out(server, s3, tmp_path, monkeypatch):
    """The state a run killed during its last uploads leaves (finished here; there no manifest, a
    part missing, another part a different file): the next run uploads exactly what the bucket
    lacks, the manifest last, and says so; the bucket then holds the local output, byte for byte.
    The same for a single-file output. The job folder is private, under the user's cache folder."""
    client, located = s3
    monkeypatch.delenv(JOBS_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    command = _encode(server, _dataset(tmp_path / "in.fasta.gz", 40), f"{located}/out/")
    first = runner.invoke(app, command)
    assert first.exit_code == 3, first.output  # partial: the bad record
    folder = local_folder(f"{located}/out/")
    assert folder.parent == tmp_path / "cache" / "bionemo-export" / "jobs"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and _said(f"job folder: {folder}") in _said(first.output)
    files = sorted(path.name for path in folder.iterdir())
    assert {"manifest.json", "journal.jsonl", "errors.tsv", "part-00004.h5"} <= set(files)
    assert _stored(client, "out/") == _local(folder, files)
    for name in files:  # each upload carries its digest, which the repair compares
        head = client.head_object(Bucket=BUCKET, Key=f"out/{name}")
        assert head["Metadata"] == {"sha256": _local(folder, [name])[name]}, name

    client.delete_object(Bucket=BUCKET, Key=f"out/{MANIFEST}")
    client.delete_object(Bucket=BUCKET, Key="out/part-00001.h5")
    client.put_object(Bucket=BUCKET, Key="out/part-00003.h5", Body=b"an older run's part",
                      Metadata={"sha256": hashlib.sha256(b"an older run's part").hexdigest()})
    again = runner.invoke(app, command)
    assert again.exit_code == 3, again.output
    said = _said(again.output)
    assert _said("the last run stopped before its output was all uploaded; uploaded the 3 files the location lacked "
                 f"(part-00001.h5, part-00003.h5, {MANIFEST}) from {folder}, {MANIFEST} last") in said, again.output
    assert _said(f"wrote {located}/out/") in said
    assert _stored(client, "out/") == _local(folder, files)
    third = runner.invoke(app, command)
    assert third.exit_code == 3 and "uploaded the" not in third.output, third.output  # nothing lacked

    # A single file: the run stopped after the errors file went up, before the file, and before the
    # stored parts were removed.
    single = _encode(server, tmp_path / "in.fasta.gz", f"{located}/single/out.h5")
    assert runner.invoke(app, single).exit_code == 3
    local = local_folder(f"{located}/single/out.h5") / "out.h5"
    client.delete_object(Bucket=BUCKET, Key="single/out.h5")
    client.put_object(Bucket=BUCKET, Key="single/out.h5.parts/journal.jsonl", Body=b"{}\n")
    again = runner.invoke(app, single)
    assert again.exit_code == 3, again.output
    assert _said("uploaded the 1 files the location lacked (out.h5)") in _said(again.output), again.output
    assert _stored(client, "single/") == {"out.h5": _local(local.parent, ["out.h5"])["out.h5"],
                                          "out.h5.errors.tsv": _local(local.parent, ["out.h5.errors.tsv"])[
                                              "out.h5.errors.tsv"]}


def test_a_job_folder_not_the_users_own_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(JOBS_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = local_folder("s3://bucket/out/")
    assert folder == local_folder("s3://bucket/out") and stat.S_IMODE(folder.stat().st_mode) == 0o700
    folder.chmod(0o777)  # opened by hand: closed again
    assert stat.S_IMODE(local_folder("s3://bucket/out/").stat().st_mode) == 0o700
    folder.rmdir()
    folder.symlink_to(tmp_path)  # put there by someone else: never followed
    with pytest.raises(Exception, match=f"{folder}: the local folder of the job on s3://bucket/out/ is not a folder"):
        local_folder("s3://bucket/out/")
    monkeypatch.setenv(JOBS_DIR_ENV, str(tmp_path / "jobs"))
    assert local_folder("s3://bucket/out/").parent == tmp_path / "jobs"
    if os.getuid() == 0:  # only root can give a folder away
        other = local_folder("s3://bucket/other/")
        os.chown(other, 65534, 65534)
        with pytest.raises(Exception, match="is owned by user id 65534, not you; remove it, or set"):
            local_folder("s3://bucket/other/")


def _renewer(uri: str) -> threading.Thread | None:
    """The thread that renews the lease `uri` while a run holds it."""
    return next((thread for thread in threading.enumerate() if thread.name == f"lease {uri}"), None)


def _lease(client, key: str) -> dict:
    return json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())


def test_one_run_at_a_time_holds_an_s3_output(s3, tmp_path):
    """Two machines (two local folders) on one output: the second refuses, naming the holder, while
    the first renews its lease past the lease's life; the lease goes when the first ends. An
    expired lease, and one whose holder ran on this machine and is gone, are taken over in one
    line; a live holder here is not. A run whose lease was taken from it stops writing."""
    client, located = s3
    output = f"{located}/leased/"
    # Renewed every third of its life: a 3 s lease outlives 2 s of a renewal's delay. (1.5 s expired once in a
    # clean-clone CI, five workers on two cores: the renewal thread or the local S3 server starved past 1 s.)
    first, second = (OutputMirror(output, tmp_path / machine, lease_seconds=3.0) for machine in ("m1", "m2"))
    notices: list[str] = []
    with first.lease(notices.append):
        renewer = _renewer(f"{output}{LEASE}")
        assert renewer is not None and renewer.daemon  # never keeps the process alive
        taken = _lease(client, f"leased/{LEASE}")
        assert (taken["host"], taken["pid"]) == (socket.gethostname(), os.getpid())
        time.sleep(3.5)  # past the lease's life: renewed meanwhile
        with pytest.raises(JobLockedError) as refused, second.lease(notices.append):
            pass
        renewed = _lease(client, f"leased/{LEASE}")
        assert renewed["owner"] == taken["owner"] and renewed["expires_at"] > taken["expires_at"]
        message = str(refused.value)
        assert (f"another run works on this job's output: host {socket.gethostname()}, pid {os.getpid()}, since "
                f"{taken['started']}") in message and f"delete {output}{LEASE}" in message and "\n" not in message
    assert _renewer(f"{output}{LEASE}") is None  # stopped
    assert "Contents" not in client.list_objects_v2(Bucket=BUCKET, Prefix="leased/")  # given back
    assert notices == []

    def left(**record) -> None:  # a lease as a run that stopped without giving it back leaves it
        future = (datetime.now(timezone.utc) + timedelta(minutes=5)).isoformat(timespec="seconds")
        client.put_object(Bucket=BUCKET, Key=f"leased/{LEASE}", Body=json.dumps({
            "host": "node7", "pid": 4242, "owner": "another", "started": "2026-01-01T00:00:00+00:00",
            "expires_at": future, "machine": "elsewhere", **record}).encode())

    left(expires_at="2026-01-01T00:05:00+00:00")
    with second.lease(notices.append):
        assert _lease(client, f"leased/{LEASE}")["pid"] == os.getpid()
    assert notices == [f"took over {output}{LEASE} from host node7, pid 4242, whose lease expired at "
                       "2026-01-01T00:05:00+00:00"]
    ended = subprocess.Popen(["true"])  # a pid that is certainly not running any more
    ended.wait()
    left(machine=_machine(), pid=ended.pid)
    with second.lease(notices.append):
        pass
    assert notices[1] == (f"took over {output}{LEASE} from host node7, pid {ended.pid}, which ran on this machine "
                          "and is no longer running")
    left(machine=_machine(), pid=os.getpid())
    with pytest.raises(JobLockedError, match=f"host node7, pid {os.getpid()}, since 2026-01-01"), \
            second.lease(notices.append):
        pass
    client.delete_object(Bucket=BUCKET, Key=f"leased/{LEASE}")

    (tmp_path / "m1").mkdir()
    (tmp_path / "m1" / "part-00000.h5").write_bytes(b"part")
    with first.lease(notices.append):
        left()  # taken over by another run while this one seemed dead
        deadline = time.monotonic() + 10
        while _renewer(f"{output}{LEASE}") is not None and time.monotonic() < deadline:
            time.sleep(0.1)  # its next renewal finds the lease another's, and the thread ends
        with pytest.raises(JobLockedError, match="lease was taken over or removed while this run held it"):
            first.part_finished(tmp_path / "m1" / "part-00000.h5")
    assert _lease(client, f"leased/{LEASE}")["owner"] == "another"  # not given back: it is not ours
    assert "leased/part-00000.h5" not in str(client.list_objects_v2(Bucket=BUCKET, Prefix="leased/"))


def test_a_second_run_on_an_s3_output_refuses_naming_the_first(server, s3, tmp_path, monkeypatch):
    """Two machines on one output: while the first holds its lease (this process, as its job run
    does), `client encode` from another local folder refuses at once, naming the holder, and sends
    nothing; once the lease is given back the same command runs, and gives the lease back too."""
    client, located = s3
    output = f"{located}/twice/"
    command = _encode(server, _dataset(tmp_path / "in.fasta.gz", 16), output)
    monkeypatch.setenv(JOBS_DIR_ENV, str(tmp_path / "machine2"))
    with OutputMirror(output, tmp_path / "machine1").lease(print):
        refused = runner.invoke(app, command)
    assert refused.exit_code == 2, refused.output  # not this run's failure: another holds the output
    assert _said(f"another run works on this job's output: host {socket.gethostname()}, pid {os.getpid()}") in _said(
        refused.output) and "Traceback" not in refused.output
    assert "Contents" not in client.list_objects_v2(Bucket=BUCKET, Prefix="twice/")
    ran = runner.invoke(app, command)
    assert ran.exit_code == 3, ran.output
    assert sorted(_stored(client, "twice/")) == ["errors.tsv", "journal.jsonl", MANIFEST, "part-00000.h5",
                                                 "part-00001.h5"]
