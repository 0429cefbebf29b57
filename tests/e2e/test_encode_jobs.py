"""Bulk encode jobs (client/jobs.py) against a real tritonserver: HDF5, Parquet and directory
outputs equal to one request per sequence; duplicates sent once; bad records listed; and a client
killed with SIGKILL at random points resumes to exactly the uninterrupted result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import h5py
import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from bionemo_export.cli.main import app
from bionemo_export.client import RepositoryClient, TritonClient
from bionemo_export.client.job_files import JOURNAL, read_part
from bionemo_export.client.jobs import EncodeJob
from bionemo_export.runtime import TritonServer
from tests.helpers.job_inputs import write_proteins

runner = CliRunner()
AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"


@pytest.fixture(scope="module")
def server(esm2_repository, tmp_path_factory, triton_install):
    work = tmp_path_factory.mktemp("jobs")
    with TritonServer(esm2_repository, install=triton_install, log_file=work / "server.log") as running:
        yield running


def _url(server) -> str:
    return f"grpc://{server.endpoints.grpc_url}"


def _dataset(path, count: int, seed: int = 0) -> list[tuple[str, str]]:
    """A gzipped FASTA of `count` proteins, some repeated, one with a character ESM-2 refuses."""
    return write_proteins(path, count, seed)


def _h5(path) -> Any:
    return h5py.File(path, "r")


def _lines(path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_job_equals_one_request_per_sequence_in_every_format(server, tmp_path):
    records = _dataset(tmp_path / "in.fasta.gz", 150)
    good = [(i, s) for i, s in records if i != "bad_char"]
    with RepositoryClient("esm2nv", _url(server)) as client:
        expected = client.seqs_to_embedding([s for _, s in good])
        hiddens, mask = client.seqs_to_hidden([s for _, s in good[:40]])

    result = runner.invoke(app, ["client", "encode", "-m", "esm2nv_embeddings", "-i", str(tmp_path / "in.fasta.gz"),
                                 "--output", str(tmp_path / "out.h5"), "--chunk-size", "32",
                                 "--triton-url", _url(server)])
    assert result.exit_code == 3, result.output  # partial: one bad record
    assert "149 of 150 records answered" in result.output and "1 bad records listed in" in result.output
    errors = (tmp_path / "out.h5.errors.tsv").read_text().splitlines()
    assert errors[0] == "id\tline\treason" and errors[1].startswith("bad_char\t") and "'J'" in errors[1]
    assert not (tmp_path / "out.h5.parts").exists()  # merged, then the parts removed
    with _h5(tmp_path / "out.h5") as saved:
        assert [i.decode() for i in saved["ids"][()]] == [i for i, _ in good]
        np.testing.assert_allclose(saved["embeddings"][()], expected, atol=1e-5)
        assert json.loads(saved.attrs["fingerprint"])["model"] == "esm2nv_embeddings"
        summary = json.loads(saved.attrs["summary"])
    repeats = len(records) - len({s for _, s in records})
    assert repeats > 5 and summary["sent"] == len(records) - repeats  # each repeated sequence sent once
    assert summary["residues"] == sum(len(s) for _, s in good)  # of the records answered, pooled or not

    parquet = runner.invoke(app, ["client", "encode", "-m", "esm2nv_embeddings", "-i", str(tmp_path / "in.fasta.gz"),
                                  "--output", str(tmp_path / "out.parquet"), "--precision", "fp16",
                                  "--triton-url", _url(server)])
    assert parquet.exit_code == 3, parquet.output
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column("id").to_pylist() == [i for i, _ in good]
    np.testing.assert_allclose(np.array(table.column("embedding").to_pylist()), expected, atol=2e-3)

    # Per-residue states, ragged: each record's rows are its residues, without padding.
    subset = tmp_path / "subset.fasta"
    subset.write_text("".join(f">{i}\n{s}\n" for i, s in good[:40]))
    per_residue = runner.invoke(app, ["client", "encode", "-m", "esm2nv_hiddens", "-i", str(subset), "--output",
                                      str(tmp_path / "residues"), "--chunk-size", "16", "--triton-url", _url(server)])
    assert per_residue.exit_code == 0, per_residue.output
    manifest = json.loads((tmp_path / "residues" / "manifest.json").read_text())
    assert [p["records"] for p in manifest["parts"]] == [16, 16, 8]
    rows = [r for p in manifest["parts"] for r in read_part(tmp_path / "residues" / p["file"]).residues or []]
    for row, (hidden, valid) in enumerate(zip(hiddens, mask)):
        np.testing.assert_allclose(rows[row], hidden[valid.astype(bool)], atol=1e-5)
    assert manifest["summary"]["residues"] == int(mask.sum())


def test_pooled_and_per_residue_outputs_come_from_one_pass_of_the_hiddens_model(server, tmp_path):
    """--include mean,bos,max,per_tok on esm2nv_hiddens: the mean equals what esm2nv_embeddings answers
    (the graph's pooling), BOS is the <cls> row of the hidden states, max the maximum over each
    record's residues, all stored with the ragged residues and sequences, duplicates included
    (copied from an earlier part). What a model or format cannot hold is refused before anything is sent."""
    records = _dataset(tmp_path / "in.fasta.gz", 60, seed=5)
    good = [(i, s) for i, s in records if i != "bad_char"]
    with RepositoryClient("esm2nv", _url(server)) as client:
        expected = client.seqs_to_embedding([s for _, s in good])
        hiddens, mask = client.seqs_to_hidden([s for _, s in good])
    result = runner.invoke(app, ["client", "encode", "-m", "esm2nv_hiddens", "-i", str(tmp_path / "in.fasta.gz"),
                                 "--output", str(tmp_path / "all.h5"), "--include", "mean,bos,max,per_tok",
                                 "--chunk-size", "8", "--triton-url", _url(server)])
    assert result.exit_code == 3, result.output
    with _h5(tmp_path / "all.h5") as saved:
        assert [i.decode() for i in saved["ids"][()]] == [i for i, _ in good]
        np.testing.assert_allclose(saved["embeddings"][()], expected, atol=1e-5)
        np.testing.assert_allclose(saved["embeddings_bos"][()], hiddens[:, 0], atol=1e-5)
        ends = saved["embedding_ptr"][()]
        values, sequences = saved["embedding"][()], saved["id"][()].tobytes().decode()
        assert ends[-1] == len(values) and saved["idptr"][-1] == len(sequences) == sum(len(s) for _, s in good)
        assert json.loads(saved.attrs["fingerprint"])["include"] == "mean,bos,max,per_tok"
        maxima = saved["embeddings_max"][()]
    starts = [0, *ends[:-1]]
    for row, (hidden, valid) in enumerate(zip(hiddens, mask)):
        own = hidden[valid.astype(bool)]
        np.testing.assert_allclose(values[starts[row]:ends[row]], own, atol=1e-5)
        np.testing.assert_allclose(maxima[row], own.max(axis=0), atol=1e-5)
    assert sequences == "".join(s for _, s in good)

    refused = [(["-m", "esm2nv_embeddings", "--include", "mean,bos", "--output", str(tmp_path / "a.h5")],
                "esm2nv_embeddings answers mean-pooled embeddings only; ask its N_hiddens sibling"),
               (["-m", "esm2nv_hiddens", "--output", str(tmp_path / "b.parquet")], "Parquet holds pooled rows"),
               (["-m", "esm2nv_hiddens", "--include", "mean,per_tok", "--output", str(tmp_path / "c.parquet")],
                "Parquet holds pooled rows"),
               # The server does not serve contacts (unloaded below): the missing model and the fix.
               (["-m", "esm2nv_embeddings", "--include", "mean,contacts", "--output", str(tmp_path / "d.h5")],
                "--include contacts asks esm2nv_contacts, which the server does not serve"),
               (["-m", "esm2nv_hiddens", "--include", "contacts", "--output", str(tmp_path / "e")],
                "build the repository with --tasks ...,contacts")]
    # The default build serves contacts; a server without them (a repository built with --tasks
    # embeddings,hiddens) is this one with its contacts model unloaded for the while.
    with TritonClient(_url(server)) as control:
        control.unload_model("esm2nv_contacts")
        try:
            deadline = time.monotonic() + 60
            while any(entry["name"] == "esm2nv_contacts" and entry.get("state") != "UNAVAILABLE"
                      for entry in control.repository_index()):
                assert time.monotonic() < deadline, control.repository_index()
                time.sleep(0.2)
            for arguments, message in refused:
                bad = runner.invoke(app, ["client", "encode", "-i", str(tmp_path / "in.fasta.gz"), *arguments,
                                          "--triton-url", _url(server)])
                assert bad.exit_code == 1 and message in " ".join(bad.output.split()), bad.output
            # Sequences asked at once: the same refusal, before anything is sent.
            at_once = runner.invoke(app, ["client", "encode", "-m", "esm2nv_embeddings", "--include", "contacts",
                                          "-s", "MKT", "--triton-url", _url(server)])
        finally:
            control.load_model("esm2nv_contacts")
    written = {p.name for p in tmp_path.iterdir()}
    assert not written & {"a.h5", "a.h5.parts", "b.parquet", "b.parquet.parts", "c.parquet", "c.parquet.parts",
                          "d.h5", "d.h5.parts", "e"}
    assert at_once.exit_code == 1 and "--include contacts asks esm2nv_contacts, which the server does not serve" \
        in " ".join(at_once.output.split()), at_once.output


def test_a_different_run_is_refused_and_a_finished_one_is_reported_not_redone(server, tmp_path):
    _dataset(tmp_path / "in.fasta.gz", 20)
    job = EncodeJob(model="esm2nv_embeddings", input=tmp_path / "in.fasta.gz", output=tmp_path / "out", chunk_size=8)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / JOURNAL).write_text(json.dumps({"fingerprint": {"model": "other", "chunk_size": 8}}) + "\n")
    with TritonClient(_url(server)) as client:
        with pytest.raises(ValueError, match="journal of another run .*model was 'other', now 'esm2nv_embeddings'"):
            job.run(client)
        (tmp_path / "out" / JOURNAL).unlink()
        first = job.run(client)
        again = job.run(client)  # the same command once more: the finished job's account, nothing sent
        assert again == first and first.answered == 19 and first.errors == 1
        other = EncodeJob(model="esm2nv_embeddings", input=tmp_path / "in.fasta.gz", output=tmp_path / "out",
                          chunk_size=4)
        with pytest.raises(ValueError, match="holds another finished job"):
            other.run(client)


def test_a_client_killed_at_random_points_resumes_to_the_uninterrupted_result(server, tmp_path):
    _dataset(tmp_path / "in.fasta.gz", 400, seed=3)
    command = [sys.executable, "-m", "bionemo_export.cli.main", "client", "encode", "-m", "esm2nv_embeddings",
               "-i", str(tmp_path / "in.fasta.gz"), "--chunk-size", "8", "--batch-size", "4", "--in-flight", "1",
               "--triton-url", _url(server)]
    whole = subprocess.run([*command, "--output", str(tmp_path / "whole.h5")], capture_output=True, text=True)
    assert whole.returncode == 3, whole.stderr

    out = tmp_path / "resumed.h5"
    journal = tmp_path / "resumed.h5.parts" / JOURNAL
    rng = np.random.default_rng(0)
    kills = 0
    while True:  # killed a moment after a part is recorded, until a run gets to the end
        process = subprocess.Popen([*command, "--output", str(out)], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        lines = _lines(journal)
        deadline = time.monotonic() + 60
        while process.poll() is None and _lines(journal) <= lines + 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(float(rng.uniform(0.0, 0.3)))
        if process.poll() is not None:
            break
        process.send_signal(signal.SIGKILL)
        process.wait()
        kills += 1
    assert process.returncode == 3 and kills >= 3  # 50 parts; each run gets at least two before its kill
    with _h5(tmp_path / "whole.h5") as a, _h5(out) as b:
        assert b["ids"][()].tolist() == a["ids"][()].tolist()  # every record once, in order
        assert b["index"][()].tolist() == a["index"][()].tolist()
        np.testing.assert_array_equal(b["embeddings"][()], a["embeddings"][()])
    assert (tmp_path / "resumed.h5.errors.tsv").read_text() == (tmp_path / "whole.h5.errors.tsv").read_text()


def test_two_servers_share_a_job_and_one_killed_mid_job_loses_nothing(server, esm2_repository, triton_install,
                                                                       tmp_path):
    """The job's two servers (this test starts the second): the first is stopped once a third of
    the parts are written; its requests move to the second and the result equals one server's."""
    _dataset(tmp_path / "in.fasta.gz", 300, seed=5)
    reference = EncodeJob(model="esm2nv_embeddings", input=tmp_path / "in.fasta.gz", output=tmp_path / "one.h5",
                          chunk_size=10)
    with TritonClient(_url(server)) as client:
        reference.run(client)
    with TritonServer(esm2_repository, install=triton_install, log_file=tmp_path / "first.log") as first:
        parts = tmp_path / "two.h5.parts"
        command = [sys.executable, "-m", "bionemo_export.cli.main", "client", "encode", "-m", "esm2nv_embeddings",
                   "-i", str(tmp_path / "in.fasta.gz"), "--chunk-size", "10", "--batch-size", "2", "--output",
                   str(tmp_path / "two.h5"), "--triton-url", _url(first), "--triton-url", _url(server)]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while _lines(parts / JOURNAL) < 11 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        first.stop()
        output, _ = process.communicate(timeout=300)
    assert process.returncode == 3, output  # partial: the bad record
    assert "moved off a server" in output
    with _h5(tmp_path / "one.h5") as a, _h5(tmp_path / "two.h5") as b:
        assert b["ids"][()].tolist() == a["ids"][()].tolist()
        np.testing.assert_allclose(b["embeddings"][()], a["embeddings"][()], atol=1e-6)
        assert json.loads(b.attrs["summary"])["moved"] >= 1


def test_three_shards_merged_equal_the_unsharded_job(server, tmp_path):
    """A Slurm array or an Indexed Job's way: `--shard I/3` three times, then `client merge` (in
    another order than 0, 1, 2): the same ids, order, values and errors as the job run whole, and
    the whole job's command then finds the merged output finished."""
    _dataset(tmp_path / "in.fasta.gz", 90, seed=3)
    whole = ["client", "encode", "-m", "esm2nv_hiddens", "-i", str(tmp_path / "in.fasta.gz"), "--chunk-size", "8",
             "--triton-url", _url(server)]
    assert runner.invoke(app, [*whole, "--output", str(tmp_path / "whole.h5")]).exit_code == 3
    for index in (2, 0, 1):
        result = runner.invoke(app, [*whole, "--output", str(tmp_path / f"shard-{index}"), "--shard", f"{index}/3"])
        assert result.exit_code in (0, 3), result.output
    shards = [str(tmp_path / f"shard-{index}") for index in (1, 2, 0)]
    merged = runner.invoke(app, ["client", "merge", *shards, "--output", str(tmp_path / "merged.h5")])
    assert merged.exit_code == 3, merged.output  # the bad record: partial, as the whole job
    assert "merged 3 shards: 89 of 90 records answered" in merged.output
    with _h5(tmp_path / "whole.h5") as a, _h5(tmp_path / "merged.h5") as b:
        for name in ("ids", "index", "sequence_sha256", "embedding_ptr", "id", "idptr"):
            np.testing.assert_array_equal(b[name][()], a[name][()], err_msg=name)
        # Other batches (a shard's records are batched together): float rounding, no more.
        np.testing.assert_allclose(b["embedding"][()], a["embedding"][()], atol=1e-5)
        assert json.loads(b.attrs["fingerprint"]) == json.loads(a.attrs["fingerprint"])
    assert (tmp_path / "merged.h5.errors.tsv").read_text() == (tmp_path / "whole.h5.errors.tsv").read_text()
    again = runner.invoke(app, [*whole, "--output", str(tmp_path / "merged.h5")])
    assert again.exit_code == 3 and "89 of 90 records answered" in again.output  # finished: nothing sent

    missing = runner.invoke(app, ["client", "merge", *shards[:2], "--output", str(tmp_path / "two.h5")])
    assert missing.exit_code == 1 and "shards 0/3 are missing" in missing.output, missing.output


def test_a_job_in_object_storage_resumes_on_a_fresh_machine(server, tmp_path):
    """An Indexed Job's pod: input and output in S3 (a local S3-compatible server). The first run is
    killed mid-job; the second runs with an empty local disk (a rescheduled pod), takes up the
    stored journal and parts, and the stored result equals the job run on local files."""
    import boto3

    from tests.helpers.object_store import local_s3

    _dataset(tmp_path / "in.fasta.gz", 120, seed=8)
    with TritonClient(_url(server)) as client:
        EncodeJob(model="esm2nv_embeddings", input=tmp_path / "in.fasta.gz", output=tmp_path / "local.h5",
                  chunk_size=8, batch_size=4, in_flight=1).run(client)  # the same batches as the CLI's
    with local_s3("jobs") as endpoint:
        store = boto3.client("s3", endpoint_url=endpoint)
        store.upload_file(str(tmp_path / "in.fasta.gz"), "jobs", "data/in.fasta.gz")
        located = f"s3://{endpoint.removeprefix('http://')}/jobs"
        command = [sys.executable, "-m", "bionemo_export.cli.main", "client", "encode", "-m", "esm2nv_embeddings",
                   "-i", f"{located}/data/in.fasta.gz", "--output", f"{located}/out/", "--chunk-size", "8",
                   "--batch-size", "4", "--in-flight", "1", "--triton-url", _url(server)]

        def stored_parts() -> int:
            listed = store.list_objects_v2(Bucket="jobs", Prefix="out/part-").get("Contents", [])
            return len(listed)

        first = subprocess.Popen(command, env={**os.environ, "BIONEMO_EXPORT_JOBS_DIR": str(tmp_path / "pod1")},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while stored_parts() < 4 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, "the first run ended before it could be killed"
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = subprocess.run(command, env={**os.environ, "BIONEMO_EXPORT_JOBS_DIR": str(tmp_path / "pod2")},
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == 3, second.stdout + second.stderr  # partial: the bad record
        assert f"wrote {located}/out/" in second.stdout and "resumed after" in second.stdout
        merged = runner.invoke(app, ["client", "merge", f"{located}/out/", "--output", str(tmp_path / "merged.h5")])
        assert merged.exit_code == 3, merged.output

        # A single file in object storage: its parts under out.h5.parts/ while it runs, then the file.
        single = [*command[:command.index("--output") + 1], f"{located}/single/out.h5",
                  *command[command.index("--output") + 2:]]

        def stored(prefix: str) -> list[str]:
            return [item["Key"] for item in store.list_objects_v2(Bucket="jobs", Prefix=prefix).get("Contents", [])]

        first = subprocess.Popen(single, env={**os.environ, "BIONEMO_EXPORT_JOBS_DIR": str(tmp_path / "pod3")},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while len(stored("single/out.h5.parts/part-")) < 3 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, "the first run ended before it could be killed"
        first.send_signal(signal.SIGKILL)
        first.wait()
        summaries = []
        for pod in ("pod4", "pod5"):  # resumed on a fresh disk, then found finished on another
            again = subprocess.run(single, env={**os.environ, "BIONEMO_EXPORT_JOBS_DIR": str(tmp_path / pod)},
                                   capture_output=True, text=True, timeout=300)
            assert again.returncode == 3, again.stdout + again.stderr
            summaries.append(" ".join(again.stdout.split()).partition(")")[2])  # after "job folder: ... (mirrored)"
        assert "resumed after" in summaries[0] and f"listed in {located}/single/out.h5.errors.tsv" in summaries[0]
        assert summaries[1] == summaries[0]  # the finished job's own account, nothing sent again
        assert sorted(stored("single/")) == ["single/out.h5", "single/out.h5.errors.tsv"]  # the parts are gone
        store.download_file("jobs", "single/out.h5", str(tmp_path / "single.h5"))
    with _h5(tmp_path / "local.h5") as a, _h5(tmp_path / "single.h5") as b:
        assert b["ids"][()].tolist() == a["ids"][()].tolist()
        np.testing.assert_array_equal(b["embeddings"][()], a["embeddings"][()])
    with _h5(tmp_path / "local.h5") as a, _h5(tmp_path / "merged.h5") as b:
        assert b["ids"][()].tolist() == a["ids"][()].tolist()
        np.testing.assert_array_equal(b["embeddings"][()], a["embeddings"][()])
        fingerprint = json.loads(b.attrs["fingerprint"])
    assert fingerprint["input"] == f"{located}/data/in.fasta.gz"
    assert (tmp_path / "merged.h5.errors.tsv").read_text() == (tmp_path / "local.h5.errors.tsv").read_text()


def test_the_embedding_jobs_pods_commands_shard_and_merge_to_the_whole_job(server, tmp_path):
    """The command `deploy k8s --embed-*` gives each pod of its Indexed Job, run here for each index
    (the cluster's names replaced by a local server and a local S3 store): its shards, merged, are
    the whole job's output."""
    import boto3

    from bionemo_export.deploy.embedding_job import EmbeddingJobSettings, client_command
    from tests.helpers.object_store import local_s3

    _dataset(tmp_path / "in.fasta.gz", 60, seed=11)
    with TritonClient(_url(server)) as client:
        EncodeJob(model="esm2nv_embeddings", input=tmp_path / "in.fasta.gz", output=tmp_path / "whole.h5",
                  chunk_size=16, batch_size=4, in_flight=1).run(client)
    with local_s3("data") as endpoint:
        located = f"s3://{endpoint.removeprefix('http://')}/data"
        boto3.client("s3", endpoint_url=endpoint).upload_file(str(tmp_path / "in.fasta.gz"), "data", "in.fasta.gz")
        job = EmbeddingJobSettings(input=f"{located}/in.fasta.gz", output=f"{located}/out/",
                                   model="esm2nv_embeddings", client_image="unused", shards=3, chunk_size=16,
                                   in_flight=1)
        command = client_command(job, _url(server))
        for index in range(3):
            pod = [argument.replace("$(JOB_INDEX)", str(index)) for argument in command]
            ran = subprocess.run([sys.executable, "-m", "bionemo_export.cli.main", *pod[1:], "--batch-size", "4"],
                                 env={**os.environ, "BIONEMO_EXPORT_JOBS_DIR": str(tmp_path / f"pod{index}")},
                                 capture_output=True, text=True, timeout=300)
            assert ran.returncode == 0, ran.stdout + ran.stderr  # --allow-partial: the bad record is listed
        merged = runner.invoke(app, ["client", "merge", *(f"{located}/out/shard-{index}/" for index in (2, 1, 0)),
                                     "--output", str(tmp_path / "merged.h5")])
        assert merged.exit_code == 3, merged.output
    with _h5(tmp_path / "whole.h5") as a, _h5(tmp_path / "merged.h5") as b:
        assert b["ids"][()].tolist() == a["ids"][()].tolist()
        # A shard's records are batched with each other, not as in the whole job: float rounding only.
        np.testing.assert_allclose(b["embeddings"][()], a["embeddings"][()], atol=1e-5)


def test_two_runs_started_at_once_on_one_output_one_refuses_naming_the_holder(server, tmp_path):
    """A Slurm requeue while the first run still runs: the second refuses at once with one line that
    names the first (exit status 2, no traceback), and the first finishes the job undisturbed."""
    _dataset(tmp_path / "in.fasta.gz", 200, seed=4)
    command = [sys.executable, "-m", "bionemo_export.cli.main", "client", "encode", "-m", "esm2nv_embeddings",
               "-i", str(tmp_path / "in.fasta.gz"), "--output", str(tmp_path / "out.h5"), "--chunk-size", "8",
               "--batch-size", "4", "--in-flight", "1", "--triton-url", _url(server)]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    journal = tmp_path / "out.h5.parts" / JOURNAL
    deadline = time.monotonic() + 120
    while _lines(journal) < 2 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert first.poll() is None, "the first run ended before the second started"
    # Held still while the second starts (a stopped process keeps its lock): 200 records take the
    # first run about 2 s, less than the second's start-up took once under CI's load (it then found
    # the job finished and exited 3).
    first.send_signal(signal.SIGSTOP)
    try:
        second = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        first.send_signal(signal.SIGCONT)
    said = " ".join((second.stdout + second.stderr).split())
    assert second.returncode == 2, said
    assert f"held by pid {first.pid} on host" in said and f"kill {first.pid}" in said and "Traceback" not in said
    output, _ = first.communicate(timeout=300)
    assert first.returncode == 3 and "199 of 200 records answered" in " ".join(output.split()), output
    with _h5(tmp_path / "out.h5") as saved:
        assert saved["index"][()].tolist() == sorted(set(saved["index"][()].tolist()))  # each record once, in order
        assert len(saved["ids"]) == 199


def test_a_damaged_part_is_written_again_on_resume(server, tmp_path):
    """A crash or a reboot left the last recorded part short: the resume finds it (size and SHA-256
    in the journal), says so, writes the job again from that part, and the output equals the whole run."""
    _dataset(tmp_path / "in.fasta.gz", 60, seed=6)
    said: list[str] = []
    with TritonClient(_url(server)) as client:
        EncodeJob(model="esm2nv_hiddens", input=tmp_path / "in.fasta.gz", output=tmp_path / "whole",
                  chunk_size=8).run(client)
        job = EncodeJob(model="esm2nv_hiddens", input=tmp_path / "in.fasta.gz", output=tmp_path / "out",
                        chunk_size=8, notice=said.append)
        job.run(client)
        (tmp_path / "out" / "manifest.json").unlink()  # as if killed before its finishing step
        last = tmp_path / "out" / "part-00007.h5"
        last.write_bytes(last.read_bytes()[:-4096])
        summary = job.run(client)
    assert any("part-00007.h5: it holds" in line and "writing the job again from this part (1 of 8 parts)" in line
               for line in said), said
    assert summary.resumed_after == 56 and summary.answered == 59
    whole, resumed = json.loads((tmp_path / "whole" / "manifest.json").read_text()), \
        json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [p["records"] for p in resumed["parts"]] == [p["records"] for p in whole["parts"]]
    for a, b in zip(whole["parts"], resumed["parts"], strict=True):
        left, right = read_part(tmp_path / "whole" / a["file"]), read_part(tmp_path / "out" / b["file"])
        assert left.ids == right.ids and left.residues is not None and right.residues is not None
        for x, y in zip(left.residues, right.residues, strict=True):
            np.testing.assert_allclose(y, x, atol=1e-6)


def test_a_repository_rebuilt_from_another_checkpoint_is_refused_on_resume(server, esm2_repository, triton_install,
                                                                          tmp_path):
    """The same name and layout, another checkpoint's weights (the configurations differ in their
    source_sha256 stamp alone): the job started on the first repository refuses to go on against
    the second (its parts hold the first model's answers), naming the stamp, and a job given both
    servers at once is refused at start, naming them."""
    from bionemo_export.build import BuildRequest, build_repository
    from bionemo_export.testing.checkpoints import save_random_checkpoint, set_contact_head

    # test_e2e_contacts.py's checkpoint: the run's graph cache exports its five graphs once for both modules.
    checkpoint = set_contact_head(save_random_checkpoint("esm2", tmp_path / "checkpoint", seed=41), seed=42)
    other = build_repository(BuildRequest(
        family="esm2", checkpoint=checkpoint, name="esm2nv",
        out=tmp_path / "rebuilt", backend="python", optimize=False)).repository
    _dataset(tmp_path / "in.fasta.gz", 40, seed=7)
    job = EncodeJob(model="esm2nv_embeddings", input=tmp_path / "in.fasta.gz", output=tmp_path / "out", chunk_size=8)
    with TritonClient(_url(server)) as client:
        job.run(client)
    (tmp_path / "out" / "manifest.json").unlink()  # as if the job had not finished
    with TritonServer(other, install=triton_install, log_file=tmp_path / "rebuilt.log") as rebuilt:
        with TritonClient(_url(rebuilt)) as client, pytest.raises(ValueError) as refused:
            job.run(client)
        said = " ".join(str(refused.value).split())
        assert "is the journal of another run" in said and "source_sha256 was" in said, said
        both = runner.invoke(app, ["client", "encode", "-m", "esm2nv_embeddings", "-i", str(tmp_path / "in.fasta.gz"),
                                   "--output", str(tmp_path / "both.h5"), "--triton-url", _url(server),
                                   "--triton-url", _url(rebuilt)])
    assert both.exit_code == 1 and f"--triton-url {_url(rebuilt)} serves esm2nv_embeddings with other configurations " \
        f"than {_url(server)}" in " ".join(both.output.split()), both.output
    assert not (tmp_path / "both.h5.parts").exists()  # refused before anything was written
