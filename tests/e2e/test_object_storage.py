"""Repositories in object storage: tritonserver reads an s3:// location itself.

The embedded tritonserver 2.51 (nvidia-pytriton) has Triton's S3 file system built in. A local
S3-compatible server (moto's ThreadedMotoServer on a free loopback port) holds a tiny random ESM-2
repository uploaded by `bionemo-export repo push`; the real `bionemo-export serve` serves it from
`s3://127.0.0.1:PORT/bucket/path` (Triton downloads each model folder, nothing here does) and its
answers are compared with PyTorch. Wrong locations end `serve` with one line before any server
starts.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import boto3
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from bionemo_export import procfs
from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.cli.main import app
from bionemo_export.client import EncoderClient
from bionemo_export.doctor import object_stores
from bionemo_export.model_repository.manifest import Manifest
from bionemo_export.model_repository.options import ServingOptions
from bionemo_export.models import get_family
from bionemo_export.runtime import TritonServer, find_tritonserver, free_ports
from bionemo_export.runtime.discovery import TritonInstall
from bionemo_export.runtime.object_storage import S3RepositoryError, check_s3_repository, list_repository, parse_s3_uri
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.helpers import serve_process as sp
from tests.helpers.object_store import local_s3

NAME = "s3esm"
BUCKET = "bionemo-models"
PREFIX = "teams/proteins/esm2_tiny"
ATOL = 1e-4
SEQUENCES = ["MSLKRKNIALIPAAGIGVRFG", "MKTAY", "MKTAYIAKQRQISFVKSHFSRQ"]
WIDE = {"COLUMNS": "200"}

runner = CliRunner()


# -- locations, as tritonserver reads them (no server) ------------------------------------------

@pytest.mark.parametrize(("uri", "bucket", "prefix", "endpoint"), [
    ("s3://127.0.0.1:9000/models/esm2", "models", "esm2", "http://127.0.0.1:9000"),
    ("s3://minio.local:9000/models//a/b_c/", "models", "a/b_c", "http://minio.local:9000"),
    ("s3://https://store.example:443/models/x", "models", "x", "https://store.example:443"),
    ("s3://my-bucket/deep/path/", "my-bucket", "deep/path", None),
    ("s3://my-bucket", "my-bucket", "", None),
])
def test_locations_split_as_tritonserver_splits_them(uri, bucket, prefix, endpoint):
    location = parse_s3_uri(uri)
    assert (location.bucket, location.prefix, location.endpoint_url) == (bucket, prefix, endpoint)


@pytest.mark.parametrize("uri", ["s3://127.0.0.1:9000/Models/x", "s3://127.0.0.1:9000/models/my models",
                                 "s3://127.0.0.1:9000/models/a+b", "s3://", "s3:///"])
def test_a_location_tritonserver_would_misread_is_refused(uri):
    with pytest.raises(S3RepositoryError, match="s3://"):
        parse_s3_uri(uri)


def test_the_server_is_given_the_location_unchanged(triton_install):
    """No local folder is required and none is made: the location goes to tritonserver as written."""
    uri = "s3://127.0.0.1:9000/models/esm2"
    server = TritonServer(uri, install=triton_install)
    assert server.model_repository == server.served_path == uri
    assert f"--model-repository={uri}" in server.command()


# -- a local S3-compatible server ---------------------------------------------------------------

@pytest.fixture(scope="module")
def object_store():
    """The endpoint (http://127.0.0.1:PORT) of a local S3 server holding an empty bucket; its dummy
    credentials are in the environment, where the serve processes started later find them."""
    with local_s3(BUCKET) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def esm2(tmp_path_factory):
    """(repository folder, loaded reference model) of a tiny random ESM-2 build."""
    family = get_family("esm2")
    work = tmp_path_factory.mktemp("esm2")
    checkpoint = save_random_checkpoint(family.name, work / "checkpoint", seed=0)
    build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name=NAME, out=work / "repo",
                                  backend="python", serving=ServingOptions(max_batch_size=4),
                                  tasks=("embeddings", "hiddens"), optimize=False))
    return work / "repo", family.load(checkpoint)


def _location(endpoint: str, path: str = PREFIX) -> str:
    return f"s3://{endpoint.removeprefix('http://')}/{BUCKET}/{path}"


@pytest.fixture(scope="module")
def pushed(object_store, esm2) -> str:
    """The s3:// location `repo push` uploaded the repository to."""
    uri = _location(object_store)
    result = runner.invoke(app, ["repo", "push", str(esm2[0]), uri], env=WIDE)
    assert result.exit_code == 0, result.output
    assert f"serve it with: bionemo-export serve {uri}" in result.output
    return uri


@pytest.fixture(scope="module")
def served(pushed, tmp_path_factory):
    """The real `bionemo-export serve` on the s3:// location, probing its models every 2 s."""
    serve = sp.serve(pushed, tmp_path_factory.mktemp("serve"), "--health-interval", "2")
    yield serve
    serve.stop()


def _files(folder: Path) -> list[str]:
    return sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())


def _empty_folders(folder: Path) -> list[str]:
    return sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*")
                  if path.is_dir() and not any(path.iterdir()))


def test_the_pushed_repository_is_complete(pushed, esm2, object_store):
    """Every file Triton needs is in the store, byte for byte (configs, model.py, ONNX graphs,
    tokenizer files, the manifest). A build leaves no empty folder: each ensemble's version folder
    holds a README.md, since object storage keeps no empty folders and Triton would find no version
    of the ensemble."""
    folder = esm2[0]
    files = _files(folder)
    assert _empty_folders(folder) == []
    assert {f"{NAME}_embeddings/1/README.md", f"{NAME}_hiddens/1/README.md"} <= set(files)
    assert list_repository(pushed) == files
    assert {"manifest.json", f"{NAME}_encoder/config.pbtxt", f"{NAME}_embeddings/config.pbtxt"} <= set(files)
    client = boto3.client("s3", endpoint_url=object_store)
    for relative in files:
        stored = client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{relative}")["Body"].read()
        assert stored == (folder / relative).read_bytes(), relative


def _older_repository(esm2, tmp_path) -> Path:
    """A copy of the repository as builds before the ensemble README.md wrote it: empty version
    folders, and (older still) no file digests in manifest.json."""
    older = Path(shutil.copytree(esm2[0], tmp_path / "older"))
    for note in older.glob("*/1/README.md"):
        note.unlink()
    replace(Manifest.read(older), files={}).write(older)
    return older


def test_push_marks_the_empty_folders_of_an_older_repository(esm2, object_store, tmp_path):
    """Each empty folder gets a marker object, which Triton reads as the folder."""
    older = _older_repository(esm2, tmp_path)
    uri = _location(object_store, "teams/older")
    result = runner.invoke(app, ["repo", "push", str(older), uri], env=WIDE)
    assert result.exit_code == 0, result.output
    empty = _empty_folders(older)
    assert {f"{NAME}_embeddings/1", f"{NAME}_hiddens/1"} <= set(empty)
    assert list_repository(uri) == sorted(_files(older) + [name + "/" for name in empty])
    client = boto3.client("s3", endpoint_url=object_store)
    for name in empty:
        assert client.get_object(Bucket=BUCKET, Key=f"teams/older/{name}/")["Body"].read() == b""
    assert check_s3_repository(uri)


def test_tritonserver_reads_the_location_itself(served, pushed):
    """The server process was given the s3:// location, not a local copy."""
    server = sp.tritonserver_of(served.process.pid)
    arguments = procfs.command_line(server) or []
    assert f"--model-repository={pushed}" in arguments


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_answers_from_object_storage_match_pytorch(served, esm2, protocol):
    loaded = esm2[1]
    port = served.http if protocol == "http" else served.grpc
    with EncoderClient(NAME, f"{protocol}://127.0.0.1:{port}") as client:
        embeddings = client.seqs_to_embedding(SEQUENCES)
        hiddens, mask = client.seqs_to_hidden(SEQUENCES)
    encoded = loaded.tokenizer.encode(SEQUENCES)
    with torch.no_grad():
        ref_hiddens, ref_embeddings = loaded.encoder(*(torch.from_numpy(a) for a in (
            encoded.input_ids, encoded.attention_mask, encoded.residue_mask)))
    assert embeddings.shape == (len(SEQUENCES), loaded.hidden_size)
    assert np.abs(embeddings - ref_embeddings.numpy()).max() <= ATOL
    real = encoded.attention_mask.astype(bool)
    assert hiddens.shape == ref_hiddens.shape
    assert np.abs(hiddens - ref_hiddens.numpy())[real].max() <= ATOL
    assert [int(row.sum()) for row in mask] == [len(s) for s in SEQUENCES]


def test_the_supervisor_probes_the_models_of_an_s3_repository(served):
    """serve's supervisor finds the public models through the server (the manifest is not local)."""
    served.wait_for(f"health: watching {NAME}_embeddings, {NAME}_hiddens", timeout=30)


# -- wrong locations: one line, before any server starts ----------------------------------------

def _serve_error(location: str, env: dict[str, str | None] | None = None) -> str:
    """The output of `serve LOCATION`, asserted to be one handled error line (exit status 2)."""
    result = runner.invoke(app, ["serve", location, "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
                           env={**WIDE, **(env or {})})
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Starting" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    return result.output


def test_a_missing_location_is_named(pushed, object_store):
    uri = _location(object_store, "teams/nothing_here")
    output = _serve_error(uri)
    assert f"{uri} does not exist" in output and f"bionemo-export repo push REPO {uri}" in output


def test_a_missing_bucket_is_named(object_store):
    uri = f"s3://{object_store.removeprefix('http://')}/no-such-bucket/models"
    assert f"{uri}: bucket 'no-such-bucket' does not exist at {object_store}" in _serve_error(uri)


def test_a_folder_above_the_repository_points_to_it(pushed, object_store):
    parent = _location(object_store, "teams/proteins")
    output = _serve_error(parent)
    assert f"{parent} is not a model repository" in output and f"did you mean {pushed}?" in output


def test_missing_credentials_are_named(pushed):
    output = _serve_error(pushed, {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None})
    assert f"no S3 credentials to read {pushed}" in output and "AWS_ACCESS_KEY_ID" in output


def test_an_unreachable_store_is_named(object_store):
    uri = f"s3://127.0.0.1:{free_ports(1)[0]}/{BUCKET}/{PREFIX}"  # nothing listens there
    assert f"{uri}: cannot read the object store" in _serve_error(uri)


def _upload_files_only(folder: Path, object_store: str, path: str) -> str:
    """What `aws s3 sync` uploads: the files only, no empty folders."""
    client = boto3.client("s3", endpoint_url=object_store)
    for relative in _files(folder):
        client.upload_file(str(folder / relative), BUCKET, f"{path}/{relative}")
    return _location(object_store, path)


def test_a_files_only_copy_of_a_build_is_a_complete_repository(esm2, object_store):
    assert check_s3_repository(_upload_files_only(esm2[0], object_store, "teams/synced"))


def test_a_files_only_copy_of_an_older_repository_is_refused(esm2, object_store, tmp_path):
    """The ensembles of an older repository then have no version folder and Triton would refuse
    them; serve says which models and how to upload instead."""
    uri = _upload_files_only(_older_repository(esm2, tmp_path), object_store, "teams/synced-older")
    output = _serve_error(uri)
    assert f"{uri}: {NAME}_embeddings, {NAME}_hiddens have no version folder" in output
    assert f"bionemo-export repo push REPO {uri} --replace" in output


def test_a_location_tritonserver_would_misread_ends_serve_with_one_line(object_store):
    uri = _location(object_store, "teams/my models")
    assert f"tritonserver cannot read {uri}" in _serve_error(uri)


# -- repo push ----------------------------------------------------------------------------------

def test_push_refuses_to_mix_repositories_and_replace_removes_stale_models(object_store, esm2, tmp_path):
    """A model folder left at the location would be loaded as part of the repository, so a second
    push there is refused, and --replace leaves exactly the new repository."""
    uri = _location(object_store, "teams/replaced")
    stale = tmp_path / "old"
    (stale / "old_model").mkdir(parents=True)
    (stale / "old_model" / "config.pbtxt").write_text('name: "old_model"\nbackend: "python"\n')
    assert runner.invoke(app, ["repo", "push", str(stale), uri], env=WIDE).exit_code == 0

    refused = runner.invoke(app, ["repo", "push", str(esm2[0]), uri], env=WIDE)
    assert refused.exit_code == 2 and f"{uri} already holds 1 objects: pass --replace" in refused.output
    assert list_repository(uri) == ["old_model/config.pbtxt"]

    replaced = runner.invoke(app, ["repo", "push", str(esm2[0]), uri, "--replace"], env=WIDE)
    assert replaced.exit_code == 0, replaced.output
    assert list_repository(uri) == sorted(_files(esm2[0]) + [name + "/" for name in _empty_folders(esm2[0])])


def test_push_refuses_a_folder_that_is_not_a_repository(object_store, tmp_path):
    result = runner.invoke(app, ["repo", "push", str(tmp_path), _location(object_store, "teams/empty")], env=WIDE)
    assert result.exit_code == 2 and "is not a model repository" in result.output


def test_doctor_reads_object_storage_support_from_the_servers_library(tmp_path):
    """The embedded tritonserver's library has Triton's S3 file system; a library without it does not."""
    stores = object_stores(find_tritonserver())
    assert stores is not None and "s3://" in stores, stores
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libtritonserver.so").write_bytes(b"\x7fELF no file systems here")
    bare = TritonInstall(binary=tmp_path / "bin" / "tritonserver", backend_directory=tmp_path / "backends",
                         source="explicit")
    assert object_stores(bare) == []
    (tmp_path / "lib" / "libtritonserver.so").unlink()
    assert object_stores(bare) is None
