"""Kubernetes manifests that serve a generated model repository with NVIDIA's Triton container.

`write_manifests` writes two alternatives into one folder, each a multi-document YAML file of
plain Kubernetes objects (the builders here return dicts; pyyaml serializes them):

- `kserve-inferenceservice.yaml`: a KServe `InferenceService` (serving.kserve.io/v1beta1) whose
  predictor runs KServe's Triton runtime (`modelFormat: triton`). KServe's storage initializer
  copies the repository from `storageUri` (s3://, gs:// or pvc://) to /mnt/models, where the
  runtime's tritonserver reads it (`--model-store=/mnt/models`, HTTP on 8080, gRPC on 9000).
- `triton-deployment.yaml`: a `Deployment` running `tritonserver` from the given image, a
  `Service` (http 8000, grpc 8001, metrics 8002) and a `HorizontalPodAutoscaler`. Triton reads
  an s3:// or gs:// repository itself; a pvc:// repository is mounted read-only at /mnt/models.
  Without a storage URI the repository lives on a PersistentVolumeClaim that this module also
  writes (`repository-volume.yaml`: the claim and a loader pod to `kubectl cp` the folder into).

Which models Triton loads, and why explicitly: `--model-control-mode=explicit` with one
`--load-model` per model folder of the repository, internal models included. The public models
are ensembles and Python models: Triton loads an ensemble's steps with it, but the models a
Python model calls through BLS (the decode loops call the encoder and decoder graphs) are
invisible to Triton's dependency tracking, so loading only the public models would leave them
unloaded and the first request would fail. `none` mode would load them all too, but it disables
the repository API (load/unload) that an operator, or `bionemo-export serve`'s supervisor,
reloads a broken model through; `poll` would load a repository that is still being copied.
With `--strict-readiness=true`, /v2/health/ready answers 200 only when every model is ready.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bionemo_export.choices import DeployTarget
from bionemo_export.errors import UserError
from bionemo_export.model_repository.backends import deployment_note
from bionemo_export.model_repository.manifest import MANIFEST_NAME, Manifest, ManifestError
from bionemo_export.model_repository.reader import RepositoryModels, RepositoryReadError
from bionemo_export.runtime.server import check_model_repository

# Triton's own ports (the plain Deployment) and those of KServe's Triton runtime, whose
# container args KServe appends ours to (the runtime's `--model-store`/ports come first).
TRITON_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
KSERVE_HTTP_PORT = 8080
MOUNT_PATH = "/mnt/models"
"""Where the repository is in the pod: KServe's storage initializer's folder, used for PVCs too."""
SHM_PATH = "/dev/shm"
# The Python backend exchanges every request's tensors with its stub processes through shared
# memory; a container's default /dev/shm is 64 MB, too small for batches of hidden states.
STORAGE_SCHEMES = ("s3", "gs", "pvc")
# DNS-1035 label: what Service and InferenceService names must be.
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# DNS-1123 subdomain: what a PersistentVolumeClaim's name must be.
_CLAIM = re.compile(r"[a-z0-9]([-.a-z0-9]*[a-z0-9])?")
_QUANTITY = re.compile(r"(\d+(\.\d+)?|\.\d+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
KSERVE_FILE = "kserve-inferenceservice.yaml"
DEPLOYMENT_FILE = "triton-deployment.yaml"
VOLUME_FILE = "repository-volume.yaml"
JOB_FILE = "embedding-job.yaml"
"""The optional embedding Job (deploy/embedding_job.py)."""


class DeployError(UserError, ValueError):
    """A deploy input that cannot give working manifests; the message names the input."""


@dataclass(frozen=True)
class StorageLocation:
    """Where the cluster finds the repository: `s3://bucket/path`, `gs://bucket/path` or
    `pvc://claim/path` (a PersistentVolumeClaim and the repository's folder on it)."""

    uri: str
    scheme: str
    claim: str | None = None
    """The claim's name, for pvc:// only."""
    path: str = ""
    """For pvc://: the repository's folder on the claim, '' for its root."""

    @property
    def triton_reads_it(self) -> bool:
        """Whether tritonserver reads the location itself (object storage) instead of a mounted folder."""
        return self.scheme in ("s3", "gs")


@dataclass(frozen=True)
class RepositoryFacts:
    """What the manifests must agree with: the repository's models, as folders on disk."""

    path: Path
    name: str
    """The --name it was built with (manifest.json), else the folder's name."""
    models: tuple[str, ...]
    """Every model folder (a config.pbtxt inside): what Triton must load."""
    public_models: tuple[str, ...]
    backend: str | None
    size_bytes: int
    device: str = "cpu"
    """Where its graph models run (manifest.json's `device`): a gpu repository needs GPU pods."""
    queue_limits: dict[str, int] = field(default_factory=dict)
    """Each batched model's max_queue_size (its config's default queue policy), where it has one."""


@dataclass(frozen=True)
class DeploySettings:
    """The command line's choices, checked (`check_settings`)."""

    name: str
    """Name of every object written (a DNS-1035 label)."""
    image: str
    replicas: int = 1
    max_replicas: int | None = None
    """The autoscalers' ceiling; None: `replicas` (a fixed size)."""
    gpus: int = 0
    storage: StorageLocation | None = None
    cpu: str = "2"
    memory: str = "8Gi"
    shm_size: str = "1Gi"

    @property
    def ceiling(self) -> int:
        return self.max_replicas if self.max_replicas is not None else self.replicas


# -- inputs ------------------------------------------------------------------------------------------

def parse_storage_uri(uri: str) -> StorageLocation:
    """Read a storage URI (`DeploySettings.storage`); DeployError naming it when its scheme or form
    cannot work."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in STORAGE_SCHEMES:
        raise DeployError(f"`storage` {uri}: unsupported location; use s3://bucket/path, gs://bucket/path "
                          "or pvc://claim/path (the repository's folder in object storage or on a "
                          "PersistentVolumeClaim)")
    first, _, path = rest.strip("/").partition("/")
    if not first:
        raise DeployError(f"`storage` {uri}: names no {'claim' if scheme == 'pvc' else 'bucket'}")
    if scheme == "s3":
        _s3_location(uri)  # one Triton would misread is refused here, naming it
    if scheme != "pvc":
        return StorageLocation(uri, scheme)
    if not _CLAIM.fullmatch(first) or len(first) > 253:
        raise DeployError(f"`storage` {uri}: '{first}' is not a PersistentVolumeClaim name "
                          "(lowercase letters, digits, '-' and '.')")
    return StorageLocation(uri, scheme, claim=first, path=path.strip("/"))


def _s3_location(uri: str) -> Any:
    """The s3:// location as tritonserver reads it (runtime/object_storage.py); DeployError naming
    the storage URI when Triton would misread it."""
    from bionemo_export.runtime.object_storage import S3RepositoryError, parse_s3_uri

    try:
        return parse_s3_uri(uri)
    except S3RepositoryError as err:
        raise DeployError(f"`storage` {uri}: {err}") from None


def read_repository(path: Path) -> RepositoryFacts:
    """The models of a generated repository, from its folders (model_repository/reader.py); DeployError
    (or the server's NotAModelRepositoryError) naming the folder when it is not one Triton could serve."""
    if not path.is_dir():
        raise DeployError(f"{path} is not a folder: pass the local repository folder (where the cluster reads "
                          "its copy is `storage`)")
    check_model_repository(path)
    try:
        manifest = Manifest.read(path) if (path / MANIFEST_NAME).is_file() else None
        found = RepositoryModels.read(path, manifest)
    except ManifestError as err:
        raise DeployError(f"{err}; rebuild the repository") from None
    except RepositoryReadError as err:  # its message says to rebuild
        raise DeployError(str(err)) from None
    models = found.models
    if not models:
        raise DeployError(f"{path} has no model folder (a subfolder with config.pbtxt): pass a repository "
                          "built by `bionemo-export build repo`")
    if manifest is None:  # a repository not built by bionemo-export: its folders say it all
        return RepositoryFacts(path, path.name, models, found.public, None, _size(path),
                               queue_limits=found.queue_limits())
    missing = [model for model in (*manifest.models, *manifest.public_models) if model not in models]
    if missing:
        raise DeployError(f"{path}: {MANIFEST_NAME} names models that have no folder with a config.pbtxt: "
                          f"{', '.join(missing)}; rebuild the repository")
    return RepositoryFacts(path, manifest.name or path.name, models, found.public, manifest.backend, _size(path),
                           manifest.device, found.queue_limits())


def _size(path: Path) -> int:
    """Bytes of every file under `path`: what a pod's storage must hold."""
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def default_name(repository: RepositoryFacts) -> str:
    """The objects' name when --name is not given: the repository's, as a DNS-1035 label."""
    name = re.sub(r"[^a-z0-9-]+", "-", repository.name.lower()).strip("-")
    name = re.sub(r"^[^a-z]+", "", name)[:63].rstrip("-")
    return name or "triton"


def check_settings(settings: DeploySettings, target: str) -> None:
    """DeployError naming the first setting that cannot give valid manifests for `target` (by its
    field name, in backticks: errors.py)."""
    if target not in tuple(DeployTarget):
        raise DeployError(f"`target` {target}: choose one of {', '.join(DeployTarget)}")
    if not _NAME.fullmatch(settings.name) or len(settings.name) > 63:
        raise DeployError(f"`name` {settings.name}: a Kubernetes name is at most 63 lowercase letters, digits "
                          "and '-', starting with a letter and ending with a letter or digit")
    if not settings.image.strip() or any(c.isspace() for c in settings.image):
        raise DeployError(f"`image` {settings.image!r}: give a container image, e.g. "
                          "nvcr.io/nvidia/tritonserver:24.10-py3")
    if settings.replicas < 1:
        raise DeployError(f"`replicas` {settings.replicas}: at least 1")
    if settings.ceiling < settings.replicas:
        raise DeployError(f"`max_replicas` {settings.max_replicas}: at least `replicas` ({settings.replicas})")
    if settings.gpus < 0:
        raise DeployError(f"`gpus` {settings.gpus}: 0 (CPU only) or more")
    for option, value in (("`cpu`", settings.cpu), ("`memory`", settings.memory), ("`shm_size`", settings.shm_size)):
        if not _QUANTITY.fullmatch(value):
            raise DeployError(f"{option} {value}: not a Kubernetes quantity (e.g. 2, 500m, 8Gi)")
    if target in (DeployTarget.ALL, DeployTarget.KSERVE) and settings.storage is None:
        raise DeployError("`storage` is required for the KServe InferenceService (s3://bucket/path, "
                          "gs://bucket/path or pvc://claim/path); pass `target` plain to write only the "
                          "Deployment, which then mounts a PersistentVolumeClaim")


# -- the pieces both alternatives share --------------------------------------------------------------

def triton_model_args(repository: RepositoryFacts) -> list[str]:
    """Explicit model control with every model of the repository loaded (see the module's docstring)."""
    return ["--model-control-mode=explicit", *(f"--load-model={model}" for model in repository.models),
            "--strict-readiness=true"]


def selector(settings: DeploySettings, component: str = "triton-inference-server") -> dict[str, str]:
    """The labels that pick the serving pods: name and component, so that the loader pod (same
    name, another component) never receives the Service's traffic."""
    return {"app.kubernetes.io/name": settings.name, "app.kubernetes.io/component": component}


def labels(settings: DeploySettings, component: str = "triton-inference-server") -> dict[str, str]:
    return {**selector(settings, component), "app.kubernetes.io/managed-by": "bionemo-export"}


def resources(settings: DeploySettings) -> dict[str, Any]:
    """CPU and memory requests (the autoscaler's utilization is relative to them) and limits:
    memory (the /dev/shm emptyDir counts against it) and the GPUs asked for."""
    limits: dict[str, str] = {"memory": settings.memory}
    if settings.gpus:
        limits["nvidia.com/gpu"] = str(settings.gpus)
    return {"requests": {"cpu": settings.cpu, "memory": settings.memory}, "limits": limits}


def shm_volume(settings: DeploySettings) -> dict[str, Any]:
    return {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}}


def shm_mount() -> dict[str, Any]:
    return {"name": "dshm", "mountPath": SHM_PATH}


def http_probe(path: str, port: int | str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 5}


# A readiness check run inside Triton's container (its python3): ready when Triton is, and not while
# a model's queue is full, so that the Service stops sending a saturated pod new work (its clients
# would be answered 503) while the autoscaler adds pods. {ready} and {metrics} are URLs, {limits}
# maps models to their max_queue_size.
SATURATION_CHECK = """\
import json, re, sys, urllib.request
limits = json.loads({limits!r})
urllib.request.urlopen({ready!r}, timeout=4)
for line in urllib.request.urlopen({metrics!r}, timeout=4).read().decode().splitlines():
    m = re.match(r'nv_inference_pending_request_count\\{{model="([^"]+)".*\\}} (\\S+)$', line)
    if m and m.group(1) in limits and float(m.group(2)) >= limits[m.group(1)]:
        sys.exit("saturated: " + m.group(1))
"""


def readiness_probe(repository: RepositoryFacts, http_port: int, metrics_port: int) -> dict[str, Any]:
    """Ready when Triton's /v2/health/ready answers and no model's queue is full (an exec probe;
    an HTTP probe of /v2/health/ready alone when no model bounds its queue)."""
    if not repository.queue_limits:
        return http_probe("/v2/health/ready", http_port, period=5, failures=3)
    script = SATURATION_CHECK.format(limits=json.dumps(repository.queue_limits, sort_keys=True),
                                     ready=f"http://127.0.0.1:{http_port}/v2/health/ready",
                                     metrics=f"http://127.0.0.1:{metrics_port}/metrics")
    return {"exec": {"command": ["python3", "-c", script]}, "periodSeconds": 5, "failureThreshold": 2,
            "successThreshold": 1, "timeoutSeconds": 5}


# -- KServe ------------------------------------------------------------------------------------------

def kserve_storage_uri(storage: StorageLocation) -> str:
    """The location as KServe's storage initializer reads it: s3://bucket/path with the endpoint
    of an S3-compatible store given separately (the S3 secret's serving.kserve.io/s3-endpoint),
    not in Triton's s3://host:port/bucket/path form."""
    if storage.scheme != "s3":
        return storage.uri
    location = _s3_location(storage.uri)
    return f"s3://{location.bucket}/{location.prefix}".rstrip("/")


def inference_service(repository: RepositoryFacts, settings: DeploySettings) -> dict[str, Any]:
    """The KServe InferenceService: Triton runtime, the repository from storageUri at /mnt/models."""
    assert settings.storage is not None, "check_settings requires a storage URI for KServe"
    model = {
        "modelFormat": {"name": "triton"},
        "protocolVersion": "v2",
        "storageUri": kserve_storage_uri(settings.storage),
        "image": settings.image,
        # Appended to the runtime's own args (tritonserver --model-store=/mnt/models ...).
        "args": triton_model_args(repository),
        # Knative routes one port: HTTP (KServe's v2 REST); gRPC users declare h2c 9000 instead.
        "ports": [{"name": "http1", "containerPort": KSERVE_HTTP_PORT, "protocol": "TCP"}],
        "readinessProbe": readiness_probe(repository, KSERVE_HTTP_PORT, TRITON_PORTS["metrics"]),
        "resources": resources(settings),
        "volumeMounts": [shm_mount()],
    }
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {
            "name": settings.name,
            "labels": labels(settings),
            "annotations": {"serving.kserve.io/enable-prometheus-scraping": "true",
                            "prometheus.kserve.io/port": str(TRITON_PORTS["metrics"]),
                            "prometheus.kserve.io/path": "/metrics"},
        },
        "spec": {"predictor": {"minReplicas": settings.replicas, "maxReplicas": settings.ceiling,
                               "model": model, "volumes": [shm_volume(settings)]}},
    }


# -- plain Kubernetes ----------------------------------------------------------------------------------

def claim_name(settings: DeploySettings) -> str:
    """The PersistentVolumeClaim holding the repository: the pvc:// one, else the one written here."""
    if settings.storage is not None and settings.storage.claim:
        return settings.storage.claim
    return f"{settings.name}-model-repository"


def repository_location(settings: DeploySettings) -> str:
    """`--model-repository` of the plain Deployment's tritonserver."""
    storage = settings.storage
    if storage is not None and storage.triton_reads_it:
        return storage.uri
    path = storage.path if storage is not None else ""
    return f"{MOUNT_PATH}/{path}" if path else MOUNT_PATH


def triton_container(repository: RepositoryFacts, settings: DeploySettings) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "tritonserver",
        "image": settings.image,
        "command": ["tritonserver"],
        "args": [f"--model-repository={repository_location(settings)}", *triton_model_args(repository),
                 *(f"--{name}-port={port}" for name, port in TRITON_PORTS.items()),
                 # Below the pod's grace period, so in-flight requests finish before the SIGKILL.
                 "--exit-timeout-secs=30"],
        "ports": [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in TRITON_PORTS.items()],
        "readinessProbe": readiness_probe(repository, TRITON_PORTS["http"], TRITON_PORTS["metrics"]),
        "livenessProbe": http_probe("/v2/health/live", "http", period=10, failures=3),
        # Triton opens its ports only once every model is loaded: allow 20 minutes for that
        # (downloading from object storage, loading large graphs) before liveness takes over.
        "startupProbe": http_probe("/v2/health/ready", "http", period=10, failures=120),
        "resources": resources(settings),
        "volumeMounts": [shm_mount()],
    }
    if settings.storage is not None and settings.storage.scheme == "s3":
        # Triton reads AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_DEFAULT_REGION; optional, so
        # that pods with a cloud identity (IRSA) need no secret.
        container["envFrom"] = [{"secretRef": {"name": f"{settings.name}-storage-credentials", "optional": True}}]
    if settings.storage is None or not settings.storage.triton_reads_it:
        container["volumeMounts"].append({"name": "model-repository", "mountPath": MOUNT_PATH, "readOnly": True})
    return container


def deployment(repository: RepositoryFacts, settings: DeploySettings) -> dict[str, Any]:
    """Pods running tritonserver on the repository. No `replicas`: the autoscaler owns the count
    (re-applying a Deployment with replicas would reset what it scaled to); it starts at --replicas."""
    volumes = [shm_volume(settings)]
    if settings.storage is None or not settings.storage.triton_reads_it:
        volumes.append({"name": "model-repository",
                        "persistentVolumeClaim": {"claimName": claim_name(settings), "readOnly": True}})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": settings.name, "labels": labels(settings)},
        "spec": {
            "selector": {"matchLabels": selector(settings)},
            "template": {
                "metadata": {
                    "labels": labels(settings),
                    "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(TRITON_PORTS["metrics"]),
                                    "prometheus.io/path": "/metrics"},
                },
                "spec": {"terminationGracePeriodSeconds": 45,
                         "containers": [triton_container(repository, settings)], "volumes": volumes},
            },
        },
    }


def service(settings: DeploySettings) -> dict[str, Any]:
    """One ClusterIP address for the pods' HTTP, gRPC and metrics ports."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": settings.name, "labels": labels(settings),
                     "annotations": {"prometheus.io/scrape": "true",
                                     "prometheus.io/port": str(TRITON_PORTS["metrics"])}},
        "spec": {"type": "ClusterIP", "selector": selector(settings),
                 "ports": [{"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
                           for name, port in TRITON_PORTS.items()]},
    }


def horizontal_pod_autoscaler(settings: DeploySettings) -> dict[str, Any]:
    """Scale between --replicas and --max-replicas on CPU use: the Python backend's tokenizers
    and pooling run on CPU, and CPU is the one signal every cluster has; scaling on Triton's
    queue time (nv_inference_queue_duration_us) needs a Prometheus metrics adapter."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": settings.name, "labels": labels(settings)},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": settings.name},
            "minReplicas": settings.replicas,
            "maxReplicas": settings.ceiling,
            "metrics": [{"type": "Resource",
                         "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 75}}}],
        },
    }


def repository_claim(repository: RepositoryFacts, settings: DeploySettings) -> dict[str, Any]:
    """The claim the repository is copied onto when no storage URI is given: ReadWriteMany, since
    the autoscaler may place pods on several nodes; twice the repository's size, at least 1 GiB."""
    gib = max(1, math.ceil(2 * repository.size_bytes / 2**30))
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim_name(settings), "labels": labels(settings)},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": f"{gib}Gi"}}},
    }


def loader_pod(settings: DeploySettings) -> dict[str, Any]:
    """A pod that mounts the claim writable and waits, for the repository to be copied in through
    `kubectl exec ... tar`. It runs the serving image (it has tar, and is pulled anyway)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{settings.name}-repository-loader", "labels": labels(settings, "repository-loader")},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "loader", "image": settings.image, "command": ["sleep", "infinity"],
                            "volumeMounts": [{"name": "model-repository", "mountPath": MOUNT_PATH}]}],
            "volumes": [{"name": "model-repository", "persistentVolumeClaim": {"claimName": claim_name(settings)}}],
        },
    }


# -- files ---------------------------------------------------------------------------------------------

def render(documents: Iterable[dict[str, Any]], header: str) -> str:
    """Multi-document YAML with `header` as leading comment lines (pyyaml writes no comments)."""
    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.strip().splitlines())
    body = yaml.safe_dump_all(list(documents), sort_keys=False, default_flow_style=False, explicit_start=True)
    return comment + body


def _header(repository: RepositoryFacts, settings: DeploySettings, what: str) -> str:
    lines = [f"{what}, written by `bionemo-export deploy k8s` for {repository.path.name}.",
             f"Public models: {', '.join(repository.public_models) or '(none)'}; "
             f"loaded: {', '.join(repository.models)}",
             "(explicit model control: the public models call the others, some through BLS, which",
             "Triton would not load on its own)."]
    note = deployment_note(repository.backend)
    if note:
        lines += textwrap.wrap(f"{note[0].upper()}{note[1:]}.", 100)
    return "\n".join(lines)


def plain_documents(repository: RepositoryFacts, settings: DeploySettings) -> list[dict[str, Any]]:
    return [deployment(repository, settings), service(settings), horizontal_pod_autoscaler(settings)]


def write_manifests(repository: RepositoryFacts, settings: DeploySettings, out: Path,
                    target: str = DeployTarget.ALL, extra: Mapping[str, str] | None = None) -> list[Path]:
    """Write the manifests of `target` (all, kserve, plain) into `out`, and the `extra` files
    (name -> text: the embedding Job, deploy/embedding_job.py) with them; the files written.
    Files of an earlier run that this one does not write are removed."""
    check_settings(settings, target)
    if repository.device == "gpu" and settings.gpus < 1:
        raise DeployError(f"`gpus` {settings.gpus}: {repository.path} places its graph models on GPUs (built with "
                          f"`backend` {repository.backend} `device` gpu); pass `gpus` 1 or more, or rebuild it "
                          "with `device` cpu")
    files: dict[str, str] = {}
    if target in (DeployTarget.ALL, DeployTarget.KSERVE):
        files[KSERVE_FILE] = render([inference_service(repository, settings)],
                                    _header(repository, settings, "KServe InferenceService (Triton runtime)"))
    if target in (DeployTarget.ALL, DeployTarget.PLAIN):
        files[DEPLOYMENT_FILE] = render(plain_documents(repository, settings),
                                        _header(repository, settings, "Deployment, Service and autoscaler"))
        if settings.storage is None:
            loader = loader_pod(settings)["metadata"]["name"]
            files[VOLUME_FILE] = render(
                [repository_claim(repository, settings), loader_pod(settings)],
                "Apply first and wait for the loader pod (`kubectl wait --for=condition=Ready pod/"
                f"{loader}`); copy the\nrepository onto the claim with `tar -C {repository.path} -cf - . | "
                f"kubectl exec -i {loader} -- tar -C {MOUNT_PATH} -xf -`;\nthen `kubectl delete pod {loader}` "
                f"and apply {DEPLOYMENT_FILE}.")
    files.update(extra or {})
    out.mkdir(parents=True, exist_ok=True)
    for stale in (KSERVE_FILE, DEPLOYMENT_FILE, VOLUME_FILE, JOB_FILE):  # an earlier run's, for other choices
        if stale not in files:
            (out / stale).unlink(missing_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
    return [out / name for name in files]
