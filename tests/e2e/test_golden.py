"""Golden answers: a repository checks itself on the host that serves it (serving/golden.py), and
int8 graphs that hold on CPUs without VNNI (exporters/optimize/quantization.py).

The unit tests are tests/unit/test_golden_answers.py. The end-to-end tests here build a
tiny int8 ESM-2 repository, run its copied served modules on an emulated AVX2-only CPU
(`qemu-x86_64 -cpu Haswell`, Debian's qemu-user, installed by scripts/setup.sh) and serve it with
the real tritonserver after its golden answers were made to disagree.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bionemo_export.choices import Precision
from bionemo_export.serving import host as host_module
from bionemo_export.serving.golden import CHECK_ENV, read_golden, write_golden
from tests.unit.test_golden_answers import WEIGHTS, golden_inputs, store


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def int8_repository(tmp_path_factory) -> Path:
    """A tiny random ESM-2 built in int8 for the Python backend (embeddings only), of the seed the
    other modules build (its fp32 export from the run's graph cache)."""
    from bionemo_export.build import BuildRequest, build_repository
    from bionemo_export.testing.checkpoints import save_random_checkpoint

    folder = tmp_path_factory.mktemp("golden")
    checkpoint = save_random_checkpoint("esm2", folder / "checkpoint", seed=0)
    build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="esm", out=folder / "repo",
                                  backend="python", precision=Precision.INT8, tasks=("embeddings",)))
    return folder / "repo"


SERVED_CHECK = """
import json, sys
here = sys.argv[1]
sys.path.insert(0, here)
import numpy as np
import onnxruntime as ort
from bionemo_serving.golden import GOLDEN_FILE, read_golden
from bionemo_serving.host import cpu_description
from bionemo_serving.onnx_session import graph_for_this_host
graph = graph_for_this_host(here, ["CPUExecutionProvider"])
golden = read_golden(here + "/" + GOLDEN_FILE)
session = ort.InferenceSession(graph, providers=["CPUExecutionProvider"])
names = list(golden.references)
answers = session.run(names, {i.name: golden.inputs[i.name] for i in session.get_inputs()})
checks = golden.check(dict(zip(names, answers)))
answer = answers[names.index("embeddings")]
print(json.dumps({"cpu": cpu_description(), "graph": graph[len(here) + 1:], "passed": [c.passed for c in checks],
                  "min_cosine": [c.figures.min_cosine for c in checks], "answer": answer.tolist()}))
"""


def run_served_check(version_folder: Path, emulate: str | None) -> dict:
    command = [sys.executable, "-c", SERVED_CHECK, str(version_folder)]
    if emulate:
        command = ["qemu-x86_64", "-cpu", emulate, *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_int8_build_stores_a_graph_exact_on_cpus_without_vnni(int8_repository):
    version = int8_repository / "esm_encoder" / "1"
    assert (version / "model.onnx").is_file() and (version / "golden.npz").is_file()
    manifest = json.loads((int8_repository / "manifest.json").read_text())
    export = manifest["export"]["encoder"]
    assert manifest["build_host"]["cpu"] == host_module.cpu_description()
    assert "esm_encoder/1/golden.npz" in manifest["files"]
    if (version / "no-vnni").exists() or host_module.cpu_description()["vnni"]:
        # both ladders pass (on a VNNI build host the u8s8 graph is exact, so it passes as it will serve)
        assert export["optimization"]["quantization"]["weights"] == "int8"
        assert export["optimization_no_vnni"]["quantization"]["weights"] == "uint8"
        assert "esm_encoder/1/no-vnni/model.onnx" in manifest["files"]
        assert manifest["verification"]["graphs"]["encoder"]["no_vnni"]["outputs"]
    else:  # a build host without VNNI whose u8s8 graphs all saturated: the exact graph alone
        assert export["optimization"]["quantization"]["weights"] == "uint8"
        assert "optimization_no_vnni" not in export


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None,
                    reason="qemu-user is not installed (scripts/setup.sh installs it): no emulated AVX2-only CPU")
def test_on_an_avx2_only_cpu_the_served_int8_graph_is_the_exact_one_and_answers_as_here(int8_repository):
    """Under `qemu-x86_64 -cpu Haswell` ONNX Runtime runs its AVX2 kernels (no VNNI): the served
    modules open no-vnni/model.onnx, which meets the golden tolerance and answers as it does on
    this host (u8u8 integer sums are exact on every kernel)."""
    version = int8_repository / "esm_encoder" / "1"
    exact = "no-vnni/model.onnx" if (version / "no-vnni").exists() else "model.onnx"  # u8u8 alone: model.onnx
    emulated = run_served_check(version, "Haswell")
    assert emulated["cpu"]["vnni"] is False and "avx512f" not in emulated["cpu"]["features"]
    assert emulated["graph"] == exact
    assert all(emulated["passed"]), emulated["min_cosine"]
    here = subprocess.run([sys.executable, "-c", SERVED_CHECK.replace(
        "graph = graph_for_this_host(here, [\"CPUExecutionProvider\"])", f"graph = here + '/{exact}'"),
        str(version)], capture_output=True, text=True, timeout=600)
    native = json.loads(here.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(np.array(emulated["answer"]), np.array(native["answer"]), rtol=0, atol=1e-5)


def test_a_repository_whose_golden_answers_disagree_here_is_not_served(int8_repository, tmp_path, triton_install,
                                                                       monkeypatch):
    from bionemo_export.runtime import TritonServer
    from bionemo_export.runtime.server import TritonStartError

    repo = tmp_path / "repo"
    shutil.copytree(int8_repository, repo)
    path = repo / "esm_encoder" / "1" / "golden.npz"
    golden = read_golden(str(path))
    wrong = {name: value[::-1].copy() for name, value in golden.references.items()}  # rows swapped
    write_golden(str(path), golden.inputs, wrong, mask_input=golden.mask_input, tolerances=golden.tolerances)
    monkeypatch.delenv(CHECK_ENV, raising=False)
    server = TritonServer(repo, install=triton_install, log_file=tmp_path / "refused.log")
    with pytest.raises(TritonStartError) as refused:
        server.start(timeout=180)
    message = " ".join(str(refused.value).split())
    assert "esm_encoder" in message
    assert "answers the build's golden inputs outside its tolerance on this host" in message
    assert "embeddings: min cosine" in message and "(required >= 0.999)" in message
    assert "int8 dot products:" in message and "--golden-check warn" in message
    assert not server.is_running()

    monkeypatch.setenv(CHECK_ENV, "warn")  # the override: served, with the warning in the log
    server = TritonServer(repo, install=triton_install, log_file=tmp_path / "warned.log")
    server.start(timeout=180)
    try:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(server.endpoints.http_url)
        assert client.is_model_ready("esm_embeddings")
    finally:
        server.stop()
    log = (tmp_path / "warned.log").read_text()
    assert f"(served anyway: {CHECK_ENV}=warn)" in log


def test_verify_without_a_checkpoint_runs_the_golden_answers_here(int8_repository, tmp_path):
    from bionemo_export.verify import verify_golden
    from tests.helpers.cli import CLI

    checks = verify_golden(int8_repository)
    assert checks and all(check.passed for check in checks), [check.to_dict() for check in checks]
    assert {check.model for check in checks} == {"esm_encoder:embeddings", "esm_encoder:hiddens"}
    portable = (int8_repository / "esm_encoder" / "1" / "no-vnni").exists()
    opened = "no-vnni/model.onnx" if portable and not host_module.cpu_description()["vnni"] else "model.onnx"
    assert all(check.note.startswith(f"{opened} on this host") for check in checks)

    repo = tmp_path / "repo"
    shutil.copytree(int8_repository, repo)
    path = repo / "esm_encoder" / "1" / "golden.npz"
    golden = read_golden(str(path))
    write_golden(str(path), golden.inputs, {name: -value for name, value in golden.references.items()},
                 mask_input=golden.mask_input, tolerances=golden.tolerances)
    failed = subprocess.run([*CLI, "verify", str(repo), "--no-check"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "COLUMNS": "200"})
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "vs its golden answers, on this host" in failed.stdout and "NO" in failed.stdout
    refused = subprocess.run([*CLI, "verify", str(repo), "--url", "grpc://127.0.0.1:1"], capture_output=True,
                             text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert refused.returncode == 2 and "--url needs --checkpoint" in refused.stdout + refused.stderr


def test_an_int8_build_times_its_graphs_against_fp32_on_the_build_host(int8_repository):
    speed = json.loads((int8_repository / "manifest.json").read_text())["export"]["encoder"]["int8_speed_on_build_host"]
    portable = (int8_repository / "esm_encoder" / "1" / "no-vnni").exists()
    assert set(speed["median_ms"]) == {"fp32", "model.onnx"} | ({"no-vnni/model.onnx"} if portable else set())
    assert all(ms > 0 for ms in speed["median_ms"].values())
    cpu = host_module.cpu_description()
    opened = "no-vnni/model.onnx" if portable and not cpu["vnni"] else "model.onnx"
    assert speed["cpu"] == cpu and speed["served_here"] == opened
    assert speed["int8_vs_fp32"] == pytest.approx(speed["median_ms"]["fp32"] / speed["median_ms"][speed["served_here"]],
                                                  abs=1e-3)


MATMUL_MODEL_PY = f"""
import numpy as np
import triton_python_backend_utils as pb_utils

WEIGHTS = np.array({WEIGHTS.tolist()!r}, dtype=np.float32)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("hiddens", (x @ WEIGHTS).astype(np.float32))]))
        return responses
"""


def test_serve_asks_models_that_cannot_check_themselves_for_their_golden_answers(tmp_path, triton_install):
    """runtime/golden_answers.py through a real tritonserver: a model taking the golden inputs gives
    its answers; a right reference passes, a wrong one is refused with the figures."""
    from tritonclient.grpc import model_config_pb2 as mc

    from bionemo_export.model_repository.pbtxt import write_config
    from bionemo_export.runtime import TritonServer
    from bionemo_export.runtime.golden_answers import served_golden_checks

    repo = tmp_path / "models"
    right = golden_inputs()["x"] @ WEIGHTS
    for name, reference in (("right", right), ("wrong", -right)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(MATMUL_MODEL_PY)
        store(repo / name / "1", reference)
        write_config(repo / name, mc.ModelConfig(
            name=name, backend="python", max_batch_size=8,
            input=[mc.ModelInput(name="x", data_type=mc.TYPE_FP32, dims=[-1, 4]),
                   mc.ModelInput(name="attention_mask", data_type=mc.TYPE_INT64, dims=[-1])],
            output=[mc.ModelOutput(name="hiddens", data_type=mc.TYPE_FP32, dims=[-1, 3])],
            instance_group=[mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)]))
    with TritonServer(repo, install=triton_install, log_file=tmp_path / "server.log") as server:
        url = f"grpc://{server.endpoints.grpc_url}"
        assert served_golden_checks(repo, url) == []  # Python-backend models check themselves at load
        found = {item.model: item for item in served_golden_checks(repo, url, asked=lambda model_dir: True)}
    assert set(found) == {"right", "wrong"}
    assert found["right"].passed and found["right"].checks[0].figures.max_abs_error < 1e-5
    assert not found["wrong"].passed
    message = found["wrong"].refusal()
    assert message.startswith(f"wrong: wrong/1/model.onnx as served at {url} answers the build's golden inputs")
    assert "hiddens: min cosine -1.000000 (required >= 0.999)" in message and "This host: " in message
