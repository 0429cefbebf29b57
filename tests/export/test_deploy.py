"""`deploy k8s`: every manifest written for a real generated repository validates against the
Kubernetes API schemas (kubernetes-validate, strict) and KServe's generated API types (the kserve
SDK; see tests/helpers/manifest_validation.py), and agrees with the repository: the models Triton
loads are its model folders, ports, probes, selectors and paths line up. No cluster, no server."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.cli.main import app
from bionemo_export.deploy.kubernetes import DEPLOYMENT_FILE, KSERVE_FILE, MOUNT_PATH, VOLUME_FILE, read_repository
from bionemo_export.model_repository.options import ServingOptions
from bionemo_export.model_repository.pbtxt import read_config
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.helpers.manifest_validation import validate_inference_service, validate_kubernetes

runner = CliRunner()
WIDE = {"COLUMNS": "1000"}
IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    """A tiny random ESM-2 repository (Python backend: tokenizer, encoder and the public ensembles)."""
    root = tmp_path_factory.mktemp("esm2")
    checkpoint = save_random_checkpoint("esm2", root / "checkpoint", seed=0)
    out = root / "repo"
    build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="esm2nv", out=out, backend="python",
                                  serving=ServingOptions(max_batch_size=4), optimize=False))
    return out


def _deploy(repository: Path, out: Path, *options: str) -> dict[str, list[dict]]:
    """Run `deploy k8s`; the documents of each file it wrote, by file name."""
    result = runner.invoke(app, ["deploy", "k8s", str(repository), "--image", IMAGE, "--out", str(out), *options],
                           env=WIDE)
    assert result.exit_code == 0, result.output
    written = [Path(line.removeprefix("wrote ")) for line in result.output.splitlines() if line.startswith("wrote ")]
    assert sorted(path.name for path in out.iterdir()) == sorted(path.name for path in written)
    return {path.name: list(yaml.safe_load_all(path.read_text())) for path in written}


def _one(documents: dict[str, list[dict]], kind: str) -> dict:
    found = [doc for docs in documents.values() for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, [doc["kind"] for docs in documents.values() for doc in docs]
    return found[0]


def _model_folders(repository: Path) -> list[str]:
    return sorted(child.name for child in repository.iterdir() if (child / "config.pbtxt").is_file())


def _loaded(args: list[str]) -> list[str]:
    assert "--model-control-mode=explicit" in args, args
    return sorted(arg.removeprefix("--load-model=") for arg in args if arg.startswith("--load-model="))


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


VARIANTS = {
    "s3": ["--storage-uri", "s3://models/esm2nv", "--gpus", "1", "--replicas", "2", "--max-replicas", "4"],
    "s3-endpoint": ["--storage-uri", "s3://minio.storage:9000/models/esm2nv"],
    "pvc": ["--storage-uri", "pvc://repositories/esm/esm2nv"],
    "gs": ["--storage-uri", "gs://models/esm2nv", "--target", "kserve"],
    "plain-volume": ["--target", "plain"],
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_manifest_validates_against_the_official_schemas(repository, tmp_path, variant):
    documents = _deploy(repository, tmp_path / "k8s", *VARIANTS[variant])
    kinds = []
    for docs in documents.values():
        for doc in docs:
            if doc["kind"] == "InferenceService":
                validate_inference_service(doc)
            else:
                assert validate_kubernetes(doc) == "1.34"
            kinds.append(doc["kind"])
    expected = {"kserve": ["InferenceService"], "plain": ["Deployment", "Service", "HorizontalPodAutoscaler"]}
    want = {"gs": expected["kserve"], "plain-volume": [*expected["plain"], "PersistentVolumeClaim", "Pod"]}.get(
        variant, expected["kserve"] + expected["plain"])
    assert sorted(kinds) == sorted(want)


def test_the_validators_reject_what_a_cluster_would_reject(repository, tmp_path):
    """The checks above can fail: a misspelt field, a port given as text, a container without a
    name are each refused, by the Kubernetes schemas and by KServe's types alike."""
    documents = _deploy(repository, tmp_path / "k8s", *VARIANTS["s3"])
    isvc, deployment = _one(documents, "InferenceService"), _one(documents, "Deployment")
    model_broken = copy.deepcopy(isvc)
    broken_model = model_broken["spec"]["predictor"]["model"]
    broken_model["storageURI"] = broken_model.pop("storageUri")
    port_broken = copy.deepcopy(isvc)
    port_broken["spec"]["predictor"]["model"]["ports"][0]["containerPort"] = "8080"
    replicas_broken = copy.deepcopy(isvc)
    replicas_broken["spec"]["predictor"]["minReplicas"] = "2"
    for broken, reason in ((model_broken, "unknown field 'storageURI'"), (port_broken, "containerPort"),
                           (replicas_broken, "expected int")):
        with pytest.raises(AssertionError, match=reason):
            validate_inference_service(broken)
    unnamed = copy.deepcopy(deployment)
    del _container(unnamed)["name"]
    misspelt = copy.deepcopy(deployment)
    _container(misspelt)["livenessProbe"]["httpGet"]["paths"] = "/v2/health/live"
    text_port = copy.deepcopy(deployment)
    _container(text_port)["ports"][0]["containerPort"] = "8000"
    for broken in (unnamed, misspelt, text_port):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate_kubernetes(broken)


def test_the_models_triton_loads_are_the_repository_model_folders(repository, tmp_path):
    documents = _deploy(repository, tmp_path / "k8s", *VARIANTS["s3"])
    folders = _model_folders(repository)
    manifest = json.loads((repository / "manifest.json").read_text())
    assert folders == sorted(manifest["models"])
    for folder in folders:  # Triton serves a model under its folder's name; the config must agree
        assert read_config(repository / folder).name == folder
    isvc = _one(documents, "InferenceService")
    assert _loaded(isvc["spec"]["predictor"]["model"]["args"]) == folders
    assert _loaded(_container(_one(documents, "Deployment"))["args"]) == folders
    # The public models are loaded (a default build: every task the checkpoint serves), and so is
    # what they call (the encoder graph's model, which hosts the layers, contacts and attentions graphs).
    assert set(manifest["public_models"]) == {"esm2nv_embeddings", "esm2nv_hiddens", "esm2nv_logits",
                                              "esm2nv_scores", "esm2nv_layers", "esm2nv_contacts",
                                              "esm2nv_attentions"} < set(folders)
    assert "esm2nv_encoder" in folders
    # The header names the public models for the reader; the python backend needs onnxruntime in the image.
    header = (tmp_path / "k8s" / KSERVE_FILE).read_text().split("---")[0]
    assert "esm2nv_embeddings, esm2nv_hiddens" in header and "onnxruntime" in header


def test_repository_locations(repository, tmp_path):
    """s3:// and gs:// are read by Triton itself (KServe's initializer takes the bucket form); a
    pvc:// claim is mounted read-only and the repository's folder on it is the one served."""
    s3 = _deploy(repository, tmp_path / "s3", *VARIANTS["s3-endpoint"])
    assert _one(s3, "InferenceService")["spec"]["predictor"]["model"]["storageUri"] == "s3://models/esm2nv"
    container = _container(_one(s3, "Deployment"))
    assert container["args"][0] == "--model-repository=s3://minio.storage:9000/models/esm2nv"
    assert container["envFrom"] == [{"secretRef": {"name": "esm2nv-storage-credentials", "optional": True}}]
    assert [m["mountPath"] for m in container["volumeMounts"]] == ["/dev/shm"]

    pvc = _deploy(repository, tmp_path / "pvc", *VARIANTS["pvc"])
    assert _one(pvc, "InferenceService")["spec"]["predictor"]["model"]["storageUri"] == "pvc://repositories/esm/esm2nv"
    deployment = _one(pvc, "Deployment")
    container = _container(deployment)
    assert container["args"][0] == f"--model-repository={MOUNT_PATH}/esm/esm2nv"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "model-repository")
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "model-repository")
    assert mount == {"name": "model-repository", "mountPath": MOUNT_PATH, "readOnly": True}
    assert volume["persistentVolumeClaim"] == {"claimName": "repositories", "readOnly": True}
    assert "envFrom" not in container


def test_ports_probes_selectors_and_metrics_agree(repository, tmp_path):
    documents = _deploy(repository, tmp_path / "k8s", *VARIANTS["s3"])
    deployment, service = _one(documents, "Deployment"), _one(documents, "Service")
    hpa = _one(documents, "HorizontalPodAutoscaler")
    container = _container(deployment)
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == PORTS
    for name, port in PORTS.items():  # tritonserver listens where the container says
        assert f"--{name}-port={port}" in container["args"]
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        name: (port, name) for name, port in PORTS.items()}
    assert container["readinessProbe"]["exec"]["command"][:2] == ["python3", "-c"]  # saturation-aware
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model loading takes minutes
    template = deployment["spec"]["template"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items() and service["spec"]["selector"] == selector
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(PORTS["metrics"])
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 4)
    assert "replicas" not in deployment["spec"]  # the autoscaler owns the count
    isvc = _one(documents, "InferenceService")
    predictor = isvc["spec"]["predictor"]
    assert (predictor["minReplicas"], predictor["maxReplicas"]) == (2, 4)
    assert predictor["model"]["modelFormat"] == {"name": "triton"}
    port = predictor["model"]["ports"][0]["containerPort"]
    assert f"http://127.0.0.1:{port}/v2/health/ready" in predictor["model"]["readinessProbe"]["exec"]["command"][2]
    assert isvc["metadata"]["annotations"]["prometheus.kserve.io/port"] == str(PORTS["metrics"])


@pytest.mark.parametrize("gpus, limit", [("1", "1"), ("0", None)])
def test_gpus_give_nvidia_gpu_limits_and_every_pod_gets_a_memory_backed_dev_shm(repository, tmp_path, gpus, limit):
    documents = _deploy(repository, tmp_path / "k8s", "--storage-uri", "s3://models/esm2nv", "--gpus", gpus,
                        "--shm-size", "2Gi")
    isvc, deployment = _one(documents, "InferenceService"), _one(documents, "Deployment")
    pods = [(isvc["spec"]["predictor"]["model"], isvc["spec"]["predictor"]["volumes"]),
            (_container(deployment), deployment["spec"]["template"]["spec"]["volumes"])]
    for container, volumes in pods:
        assert container["resources"]["limits"].get("nvidia.com/gpu") == limit
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
        volume = next(v for v in volumes if v["name"] == mount["name"])
        assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}


def test_without_a_storage_uri_the_deployment_mounts_a_claim_written_beside_it(repository, tmp_path):
    documents = _deploy(repository, tmp_path / "k8s", "--target", "plain", "--name", "esm")
    assert set(documents) == {DEPLOYMENT_FILE, VOLUME_FILE}
    deployment, service = _one(documents, "Deployment"), _one(documents, "Service")
    claim, loader = _one(documents, "PersistentVolumeClaim"), _one(documents, "Pod")
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "model-repository")
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"] == "esm-model-repository"
    assert loader["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert loader["spec"]["containers"][0]["volumeMounts"][0]["mountPath"] == MOUNT_PATH
    assert _container(deployment)["args"][0] == f"--model-repository={MOUNT_PATH}"
    # The loader pod must never receive the Service's traffic.
    assert not service["spec"]["selector"].items() <= loader["metadata"]["labels"].items()
    size = sum(f.stat().st_size for f in repository.rglob("*") if f.is_file())
    assert int(claim["spec"]["resources"]["requests"]["storage"].removesuffix("Gi")) * 2**30 >= size
    assert f"tar -C {repository} -cf - ." in (tmp_path / "k8s" / VOLUME_FILE).read_text()


def test_a_second_run_leaves_only_its_own_files(repository, tmp_path):
    _deploy(repository, tmp_path / "k8s", *VARIANTS["plain-volume"])
    assert set(_deploy(repository, tmp_path / "k8s", *VARIANTS["gs"])) == {KSERVE_FILE}


def test_a_manifest_naming_a_missing_model_folder_is_refused(repository, tmp_path):
    copied = tmp_path / "repo"
    shutil.copytree(repository, copied)
    shutil.rmtree(copied / "esm2nv_encoder")
    _refused([str(copied), "--storage-uri", "s3://b/p"], f"{copied}: manifest.json names models that have no "
             "folder with a config.pbtxt: esm2nv_encoder")


def _refused(arguments: list[str], message: str) -> None:
    result = runner.invoke(app, ["deploy", "k8s", *arguments, "--image", IMAGE], env=WIDE)
    assert result.exit_code == 1, result.output
    assert result.output.count("\n") == 1 and result.output.startswith(f"error: {message}"), result.output


@pytest.mark.parametrize("options, message", [
    (["--replicas", "0"], "--replicas 0: at least 1"),
    (["--replicas", "3", "--max-replicas", "2"], "--max-replicas 2: at least --replicas (3)"),
    (["--gpus", "-1"], "--gpus -1: 0 (CPU only) or more"),
    (["--storage-uri", "http://host/models"], "--storage-uri http://host/models: unsupported location"),
    (["--storage-uri", "/data/models"], "--storage-uri /data/models: unsupported location"),
    (["--storage-uri", "pvc://"], "--storage-uri pvc://: names no claim"),
    (["--storage-uri", "s3://host:9000"], "--storage-uri s3://host:9000"),
    ([], "--storage-uri is required for the KServe InferenceService"),
    (["--storage-uri", "s3://b/p", "--name", "ESM_2"], "--name ESM_2: a Kubernetes name"),
    (["--storage-uri", "s3://b/p", "--memory", "8 GB"], "--memory 8 GB: not a Kubernetes quantity"),
    (["--storage-uri", "s3://b/p", "--target", "helm"], "--target helm: choose one of all, kserve, plain"),
])
def test_bad_options_are_one_line_naming_the_option(repository, options, message):
    _refused([str(repository), *options], message)


def test_a_folder_that_is_not_a_repository_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    _refused([str(tmp_path / "empty"), "--storage-uri", "s3://b/p"], f"{tmp_path / 'empty'} is not a model repository")
    _refused([str(tmp_path / "missing"), "--storage-uri", "s3://b/p"], f"{tmp_path / 'missing'} is not a folder")


def test_a_repository_built_for_gpus_needs_gpu_pods(repository, tmp_path):
    """manifest.json's device (gpu for --backend tensorrt or --device gpu) decides; tests/export/test_backends.py
    checks that such builds record it."""
    gpu_repository = Path(shutil.copytree(repository, tmp_path / "repo"))
    manifest = json.loads((gpu_repository / "manifest.json").read_text())
    (gpu_repository / "manifest.json").write_text(json.dumps({**manifest, "backend": "native", "device": "gpu"}))
    result = runner.invoke(app, ["deploy", "k8s", str(gpu_repository), "--image", IMAGE, "--out", str(tmp_path / "k"),
                                 "--storage-uri", "s3://models/esm2nv"], env=WIDE)
    assert result.exit_code == 1
    assert "--gpus 0: " in result.output and "places its graph models on GPUs" in result.output
    documents = _deploy(gpu_repository, tmp_path / "k8s", "--storage-uri", "s3://models/esm2nv", "--gpus", "1")
    assert _container(_one(documents, "Deployment"))["resources"]["limits"]["nvidia.com/gpu"] == "1"


def _saturation_check(documents, pending: dict[str, int]) -> subprocess.CompletedProcess:
    """Run the Deployment's readiness command against a stand-in Triton whose ready endpoint
    answers 200 and whose metrics report `pending` requests per model."""
    import http.server
    import threading

    metrics = "".join(f'nv_inference_pending_request_count{{model="{m}",version="1"}} {n}\n'
                      for m, n in pending.items()).encode()

    class Triton(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(metrics if self.path == "/metrics" else b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Triton)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        script = _container(_one(documents, "Deployment"))["readinessProbe"]["exec"]["command"][2]
        port = server.server_port
        script = script.replace(f"127.0.0.1:{PORTS['http']}", f"127.0.0.1:{port}").replace(
            f"127.0.0.1:{PORTS['metrics']}", f"127.0.0.1:{port}")
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    finally:
        server.shutdown()
        server.server_close()


def test_readiness_fails_while_a_models_queue_is_full(repository, tmp_path):
    """Finding: readiness said ready however long the queues were, so a saturated pod kept getting
    new work that its queue then refused. The probe reads Triton's pending requests and fails at a
    model's max_queue_size (from its config), so the Service routes to other pods meanwhile."""
    documents = _deploy(repository, tmp_path / "k8s", *VARIANTS["s3"])
    encoder = next(model for model in read_repository(repository).models if model.endswith("_encoder"))
    limit = read_repository(repository).queue_limits[encoder]
    assert limit == ServingOptions.max_queue_size
    assert _saturation_check(documents, {encoder: limit - 1}).returncode == 0
    full = _saturation_check(documents, {encoder: limit})
    assert full.returncode == 1 and f"saturated: {encoder}" in full.stderr


EMBED = ["--embed-input", "s3://data/uniref50.fasta.gz", "--embed-output", "s3://data/embeddings/",
         "--client-image", "registry.example/bionemo-export-client:1", "--embed-shards", "16"]


@pytest.mark.parametrize(("target", "url"), [("all", "grpc://esm2nv:8001"), ("kserve", "http://esm2nv-predictor:80")])
def test_the_embedding_job_is_an_indexed_job_against_the_servers_written_beside_it(repository, tmp_path, target, url):
    documents = _deploy(repository, tmp_path / "k8s", "--storage-uri", "s3://models/esm2nv", "--replicas", "2",
                        "--target", target, *EMBED)
    job = _one(documents, "Job")
    assert validate_kubernetes(job) == "1.34"
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 16, 4)
    assert spec["template"]["spec"]["restartPolicy"] == "Never" and spec["backoffLimitPerIndex"] == 3
    (container,) = spec["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:3] == ["bionemo-export", "client", "encode"]
    given = dict(zip(command[3::2], command[4::2], strict=False))
    assert given["--model"] == "esm2nv_embeddings" and given["--triton-url"] == url
    assert given["--shard"] == "$(JOB_INDEX)/16" and given["--output"] == "s3://data/embeddings/shard-$(JOB_INDEX)/"
    assert command[-1] == "--allow-partial"  # refused records are listed, not retried
    # $(JOB_INDEX) is expanded by Kubernetes from the container's own env: the pod's completion index.
    index = next(env for env in container["env"] if env["name"] == "JOB_INDEX")
    assert index["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert container["envFrom"][0]["secretRef"]["name"] == "esm2nv-storage-credentials"
    # Without the embed options, a second run removes the Job it wrote before.
    again = _deploy(repository, tmp_path / "k8s", "--storage-uri", "s3://models/esm2nv", "--target", target)
    assert "embedding-job.yaml" not in again
    # Pooled and per-residue outputs from the hiddens model: the pods are told what to store.
    both = _deploy(repository, tmp_path / "k8s", "--storage-uri", "s3://models/esm2nv", "--target", target, *EMBED,
                   "--embed-model", "esm2nv_hiddens", "--embed-include", "mean,per_tok")
    (container,) = _one(both, "Job")["spec"]["template"]["spec"]["containers"]
    assert container["command"][-2:] == ["--include", "mean,per_tok"]


@pytest.mark.parametrize(("options", "message"), [
    (["--embed-input", "/data/in.fasta", "--embed-output", "s3://d/o", "--client-image", "c"],
     "--embed-input /data/in.fasta: give an s3:// location"),
    (["--embed-input", "s3://d/in.fasta", "--embed-output", "s3://d/o", "--client-image", "c", "--embed-model",
      "esm2nv_encoder"], "--embed-model esm2nv_encoder: not a public model of repo"),
    (["--embed-input", "s3://d/in.fasta", "--embed-output", "s3://d/o", "--client-image", "c", "--embed-shards", "0"],
     "--embed-shards 0"),
    (["--embed-input", "s3://d/in.fasta", "--embed-output", "s3://d/o", "--client-image", "c", "--embed-include",
      "bos"], "--embed-include bos: esm2nv_embeddings answers mean-pooled embeddings only"),
])
def test_bad_embedding_job_options_are_named(repository, options, message):
    _refused([str(repository), "--storage-uri", "s3://b/p", *options], message)


def test_an_embedding_job_asking_contacts_of_a_repository_without_them_is_named(tmp_path):
    """A default build serves contacts (the checkpoint has the head); one built with --tasks
    embeddings does not, and a job that includes contacts is refused naming the build option."""
    checkpoint = save_random_checkpoint("esm2", tmp_path / "checkpoint", seed=0)
    repo = tmp_path / "repo"
    build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="esm2nv", out=repo, backend="python",
                                  tasks=("embeddings",), serving=ServingOptions(max_batch_size=4), optimize=False))
    _refused([str(repo), "--storage-uri", "s3://b/p", "--out", str(tmp_path / "k8s"), "--embed-input",
              "s3://d/in.fasta", "--embed-output", "s3://d/o", "--client-image", "c", "--embed-include",
              "mean,contacts"], "--embed-include mean,contacts: contacts asks esm2nv_contacts, which repo does not "
                                "have: build it with --tasks ...,contacts")
    assert not (tmp_path / "k8s").exists()
