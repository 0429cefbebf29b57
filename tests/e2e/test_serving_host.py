"""The serving host's commands run without torch.

A tiny ESM-2 repository is built here (torch is available to the tests), then `serve`, `health`,
`client`, `deploy`, `repo push`, `doctor` and `engines build` run as separate processes in which
torch, onnx, transformers, model_navigator and safetensors cannot be imported (a `sitecustomize.py`
on PYTHONPATH puts a finder in front of the import system that refuses them), as on a host with only
the base install. The served repository's own Python models load ONNX Runtime and numpy only (no
library of torch is mapped into tritonserver's Python stubs). The static half (the modules those
commands load import none of them) is tests/unit/test_layers.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import bionemo_export

PACKAGE_ROOT = Path(bionemo_export.__file__).parent
BLOCKED = ("torch", "onnx", "transformers", "model_navigator", "safetensors")
CLI = [sys.executable, "-m", "bionemo_export.cli.main"]

# -- end to end: the commands, without torch ------------------------------------------------------------------------

BLOCKER = f'''\
"""Tests (test_serving_host.py): make {", ".join(BLOCKED)} unimportable, as on a host without them."""
import sys

BLOCKED = {set(BLOCKED)!r}


class _Unimportable:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by test_serving_host.py)", name=name)
        return None


sys.meta_path.insert(0, _Unimportable())
'''
NAME = "bare"
SEQUENCES = ["MKTAYIAKQRQISFVKSHFSRQ", "MSLKRKNIALIPAAGIG"]
BUCKET = "models"


@dataclass
class BareHost:
    """What the e2e tests share: the repositories, the environment without torch, the servers."""

    repository: Path
    tensorrt_repository: Path
    reference_embeddings: np.ndarray
    env: dict[str, str]
    http_port: int
    serve_pid: int
    object_store: str
    work: Path

    def run(self, *args: str, columns: int = 200, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        """`bionemo-export ARGS` in a process without torch."""
        return subprocess.run([*CLI, *args], env={**self.env, "COLUMNS": str(columns)}, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=PACKAGE_ROOT.parent)


@pytest.fixture(scope="module")
def bare_host(tmp_path_factory) -> Iterator[BareHost]:
    """Repositories built here (with torch), a local S3 server, and `bionemo-export serve` started as
    a process without torch; stopped (and only what was started) at the end."""
    import torch

    from bionemo_export.build import BuildRequest, build_repository
    from bionemo_export.model_repository.options import ServingOptions
    from bionemo_export.models import get_family
    from bionemo_export.testing.checkpoints import save_random_checkpoint
    from tests.helpers import serve_process
    from tests.helpers.object_store import local_s3

    work = tmp_path_factory.mktemp("bare")
    checkpoint = save_random_checkpoint("esm2", work / "checkpoint", seed=0)
    built = {backend: work / f"repo-{backend}" for backend in ("python", "tensorrt")}
    for backend, out in built.items():
        build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name=NAME, out=out, backend=backend,
                                      serving=ServingOptions(max_batch_size=4), tasks=("embeddings",), optimize=False))
    loaded = get_family("esm2").load(checkpoint)
    encoded = loaded.tokenizer.encode(SEQUENCES)
    with torch.no_grad():
        _, embeddings = loaded.encoder(*(torch.from_numpy(a) for a in
                                         (encoded.input_ids, encoded.attention_mask, encoded.residue_mask)))

    blocker = work / "no-torch"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")]))
    # serve_process.serve starts `serve` with this process's environment, which local_s3 sets.
    with local_s3(BUCKET, {"PYTHONPATH": path, "COLUMNS": "200"}) as endpoint:
        served = serve_process.serve(built["python"], work)
        try:
            yield BareHost(built["python"], built["tensorrt"], embeddings.numpy(), dict(os.environ),
                           served.http, served.process.pid, endpoint, work)
        finally:
            served.stop()


def test_torch_and_its_kin_cannot_be_imported_there(bare_host):
    for module in BLOCKED:
        result = subprocess.run([sys.executable, "-c", f"import {module}"], env=bare_host.env, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 1 and "blocked by test_serving_host.py" in result.stderr, (module, result.stderr)


def test_serve_serves_and_health_finds_every_public_model_answering(bare_host):
    result = bare_host.run("health", f"http://127.0.0.1:{bare_host.http_port}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split()[:2] == ["ok", f"{NAME}_embeddings"], result.stdout


def test_the_served_models_load_no_torch(bare_host):
    """The repository's Python models (tritonserver's stubs, which do not read the environment's
    sitecustomize) load ONNX Runtime and numpy, and no library of torch, onnx or transformers."""
    from tests.helpers import serve_process

    stubs = serve_process.stubs(serve_process.tritonserver_of(bare_host.serve_pid))
    assert stubs
    for stub in stubs:
        mapped = {line.split()[-1] for line in (Path("/proc") / str(stub) / "maps").read_text().splitlines()
                  if "/site-packages/" in line}
        packages = {path.split("/site-packages/")[1].split("/")[0] for path in mapped}
        assert "onnxruntime" in packages, packages
        assert not packages & {"torch", "onnx", "transformers", "safetensors", "model_navigator"}, packages


def test_client_gets_the_pytorch_embeddings(bare_host):
    out = bare_host.work / "embeddings.json"
    args = [arg for sequence in SEQUENCES for arg in ("-s", sequence)]
    result = bare_host.run("client", "encode", "-m", f"{NAME}_embeddings", *args, "--output", str(out),
                           "--triton-url", f"http://127.0.0.1:{bare_host.http_port}")
    assert result.returncode == 0, result.stdout + result.stderr
    embeddings = np.array(json.loads(out.read_text())["embeddings"], dtype=np.float32)
    assert embeddings.shape == bare_host.reference_embeddings.shape
    assert np.abs(embeddings - bare_host.reference_embeddings).max() <= 1e-4


def test_deploy_writes_the_kubernetes_manifests(bare_host):
    import yaml

    out = bare_host.work / "k8s"
    result = bare_host.run("deploy", "k8s", str(bare_host.repository), "--image",
                           "nvcr.io/nvidia/tritonserver:24.10-py3", "--storage-uri", f"s3://{BUCKET}/{NAME}",
                           "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    kinds = {document["kind"] for path in out.glob("*.yaml") for document in yaml.safe_load_all(path.read_text())
             if document}
    assert {"InferenceService", "Deployment", "Service", "HorizontalPodAutoscaler"} <= kinds, kinds
    assert f"public: {NAME}_embeddings" in result.stdout


def test_repo_push_uploads_the_repository(bare_host):
    import boto3

    host_and_port = bare_host.object_store.removeprefix("http://")
    result = bare_host.run("repo", "push", str(bare_host.repository), f"s3://{host_and_port}/{BUCKET}/{NAME}")
    assert result.returncode == 0, result.stdout + result.stderr
    files = sorted(p.relative_to(bare_host.repository).as_posix() for p in bare_host.repository.rglob("*")
                   if p.is_file())
    listed = boto3.client("s3", endpoint_url=bare_host.object_store).list_objects_v2(Bucket=BUCKET, Prefix=NAME)
    assert sorted(item["Key"].removeprefix(f"{NAME}/") for item in listed["Contents"]) == files
    assert f"uploaded {len(files)} objects" in result.stdout


def test_doctor_reports_what_is_missing_instead_of_failing_on_it(bare_host):
    result = bare_host.run("doctor", columns=400)  # wide enough that no row of its table wraps
    assert "Traceback" not in result.stderr and "error:" not in result.stderr, result.stderr
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") == 6}
    assert "ok" in rows["tritonserver"] and "ok" in rows["tritonclient"], result.stdout
    for missing in ("torch", "onnx", "transformers"):
        assert "missing" in rows[missing] and "blocked by test_serving_host.py" in rows[missing], rows[missing]
        assert "build" in rows[missing], rows[missing]  # the "needed for" column
    assert "not importable" in rows["Model Navigator"], result.stdout
    # Exporting needs them: doctor, judging every job by default, says so in its exit code.
    assert result.returncode == 1, result.stdout
    assert "serve: ready" in result.stdout.splitlines(), result.stdout
    assert "build: missing Model Navigator, onnx, torch, transformers" in result.stdout
    assert "Missing required components: Model Navigator, onnx, torch, transformers" in result.stdout


def test_doctor_finds_a_serving_host_ready_to_serve(bare_host):
    result = bare_host.run("doctor", "--job", "serve", columns=400)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "serve: ready" in result.stdout.splitlines() and "build:" not in result.stdout, result.stdout
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") == 6}
    assert "not available" in rows["torch"], rows["torch"]  # absent, but serving does not need it


def test_engines_build_says_where_engines_can_be_built(bare_host):
    result = bare_host.run("engines", "build", str(bare_host.tensorrt_repository))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "TensorRT is not installed here" in result.stderr and "nvcr.io/nvidia/tritonserver" in result.stderr
    assert "ModuleNotFoundError" not in result.stdout + result.stderr
