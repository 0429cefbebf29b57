"""A Kubernetes Indexed Job that embeds a whole dataset with the servers `deploy k8s` writes.

`completions` pods, `parallelism` at a time; pod I runs

    bionemo-export client encode -m MODEL -i s3://.../input --shard I/N --output s3://.../out/shard-I/
        --triton-url <the Service or InferenceService> --allow-partial

so each pod embeds the records at positions I mod N of the input into its own folder in object
storage (runtime/job_storage.py: parts uploaded as they are written, manifest.json last). A pod
that is evicted, preempted or OOM-killed is started again and resumes from what its shard folder
holds; records the server refuses are listed in the shard's errors.tsv and do not fail the pod.
Afterwards `bionemo-export client merge s3://.../out/shard-0/ ... --output all.h5` puts the shards
together in the input's order.

Why these Job settings:
- `completionMode: Indexed`: the pod's index (the annotation batch.kubernetes.io/job-completion-
  index, passed in as JOB_INDEX) is its shard; the same index always gets the same records.
- `backoffLimitPerIndex` with `restartPolicy: Never`: a shard that keeps failing fails alone, the
  others go on. `podFailurePolicy`: exit status 2 (a wrong option or input) fails the Job at once
  instead of retrying it; a disruption (eviction, preemption, node drain) does not count as a try.
- An emptyDir for the job's local folder (BIONEMO_EXPORT_JOBS_DIR): only a cache, the shard's
  state is in object storage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bionemo_export.choices import DeployTarget
from bionemo_export.client.pooling import CONTACTS, Include
from bionemo_export.errors import InvalidInputError
from bionemo_export.tasks import sibling_model

from .kubernetes import JOB_FILE, TRITON_PORTS, DeployError, DeploySettings, RepositoryFacts, labels, render

JOBS_DIR = "/var/tmp/bionemo-export-jobs"
CLIENT_CONTAINER = "client"
USAGE_ERROR = 2
"""client encode's exit status for a wrong option or input (typer's usage errors)."""


@dataclass(frozen=True)
class EmbeddingJobSettings:
    """What `deploy k8s --embed-*` asks for, checked by `check_embedding_job`."""

    input: str
    """s3:// object of the dataset (FASTA, CSV/TSV or one per line; .gz read directly)."""
    output: str
    """s3:// folder; shard I goes to <output>/shard-I/."""
    model: str
    """The public model the pods call (an N_embeddings or N_hiddens model of the repository)."""
    client_image: str
    """An image with `bionemo-export[jobs]` installed (the client alone: no torch needed)."""
    shards: int = 8
    parallelism: int | None = None
    """Pods at once; None: as many as the servers' replicas can keep busy (2 per replica)."""
    include: str | None = None
    """What the pods store of each record (client encode --include); None: what the model answers."""
    chunk_size: int = 1024
    in_flight: int = 4
    cpu: str = "1"
    memory: str = "2Gi"
    retries_per_shard: int = 3


def check_embedding_job(job: EmbeddingJobSettings, repository: RepositoryFacts) -> None:
    """DeployError naming the first embedding-job setting that cannot work."""
    for option, location in (("`embed_input`", job.input), ("`embed_output`", job.output)):
        if not location.startswith("s3://") or len(location.rstrip("/")) <= len("s3://"):
            raise DeployError(f"{option} {location}: give an s3:// location (the pods share no disk; each reads the "
                              "input and writes its shard in object storage)")
    if job.model not in repository.public_models:
        raise DeployError(f"`embed_model` {job.model}: not a public model of {repository.path.name} (it has "
                          f"{', '.join(repository.public_models) or 'none'})")
    if not job.model.endswith(("_embeddings", "_hiddens")):
        raise DeployError(f"`embed_model` {job.model}: a bulk job embeds; give an N_embeddings or N_hiddens model")
    if job.include is not None:
        outputs = {"hiddens", "mask"} if job.model.endswith("_hiddens") else {"embeddings"}
        try:
            include = Include.parse(job.include, outputs, job.model)
        except InvalidInputError as err:
            raise DeployError(str(err).replace("--include", "`embed_include`", 1)) from None
        contacts = sibling_model(job.model, CONTACTS)
        if include.contacts and contacts not in repository.public_models:
            raise DeployError(f"`embed_include` {job.include}: contacts asks {contacts}, which {repository.path.name} "
                              "does not have: build it with --tasks ...,contacts (from an ESM checkpoint with its "
                              "contact head)")
    if not job.client_image.strip() or any(c.isspace() for c in job.client_image):
        raise DeployError(f"`client_image` {job.client_image!r}: give an image with bionemo-export[jobs] installed")
    if job.shards < 1 or (job.parallelism is not None and job.parallelism < 1):
        raise DeployError(f"`embed_shards` {job.shards} / `embed_parallelism` {job.parallelism}: at least 1 each")


def server_url(settings: DeploySettings, target: str) -> str:
    """Where the pods reach the servers: the plain Service's gRPC port when it is written, else the
    KServe predictor's HTTP address (Knative routes HTTP only)."""
    if target in (DeployTarget.ALL, DeployTarget.PLAIN):
        return f"grpc://{settings.name}:{TRITON_PORTS['grpc']}"
    return f"http://{settings.name}-predictor:80"


def client_command(job: EmbeddingJobSettings, url: str) -> list[str]:
    """The pod's command; $(JOB_INDEX) is expanded by Kubernetes from the container's env."""
    output = job.output.rstrip("/")
    return ["bionemo-export", "client", "encode", "--model", job.model, "--input", job.input,
            "--shard", f"$(JOB_INDEX)/{job.shards}", "--output", f"{output}/shard-$(JOB_INDEX)/",
            "--triton-url", url, "--chunk-size", str(job.chunk_size), "--in-flight", str(job.in_flight),
            "--allow-partial", *(["--include", job.include] if job.include is not None else [])]


def embedding_job(settings: DeploySettings, job: EmbeddingJobSettings, target: str) -> dict[str, Any]:
    """The Indexed Job (see the module's docstring)."""
    parallelism = job.parallelism or min(job.shards, 2 * settings.ceiling)
    container = {
        "name": CLIENT_CONTAINER,
        "image": job.client_image,
        "command": client_command(job, server_url(settings, target)),
        "env": [
            {"name": "JOB_INDEX", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
            {"name": "BIONEMO_EXPORT_JOBS_DIR", "value": JOBS_DIR},
        ],
        # AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION: the secret the servers read
        # their repository with; optional, for pods with a cloud identity.
        "envFrom": [{"secretRef": {"name": f"{settings.name}-storage-credentials", "optional": True}}],
        "resources": {"requests": {"cpu": job.cpu, "memory": job.memory}, "limits": {"memory": job.memory}},
        "volumeMounts": [{"name": "job-folder", "mountPath": JOBS_DIR}],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{settings.name}-embed", "labels": labels(settings, "embedding-job")},
        "spec": {
            "completionMode": "Indexed",
            "completions": job.shards,
            "parallelism": parallelism,
            "backoffLimitPerIndex": job.retries_per_shard,
            "podFailurePolicy": {"rules": [
                {"action": "FailJob",
                 "onExitCodes": {"containerName": CLIENT_CONTAINER, "operator": "In", "values": [USAGE_ERROR]}},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]},
            "template": {
                "metadata": {"labels": labels(settings, "embedding-job")},
                "spec": {"restartPolicy": "Never", "containers": [container],
                         "volumes": [{"name": "job-folder", "emptyDir": {}}]},
            },
        },
    }


def job_header(settings: DeploySettings, job: EmbeddingJobSettings) -> str:
    output = job.output.rstrip("/")
    shards = " ".join(f"{output}/shard-{index}/" for index in range(min(job.shards, 3)))
    more = " ..." if job.shards > 3 else ""
    return (f"Indexed Job: {job.shards} pods embed {job.input} with {job.model}, shard I into {output}/shard-I/.\n"
            f"Apply once the servers are ready; `kubectl wait --for=condition=complete job/{settings.name}-embed`;\n"
            f"then: bionemo-export client merge {shards}{more} --output all.h5")


def embedding_job_file(repository: RepositoryFacts, settings: DeploySettings, job: EmbeddingJobSettings,
                       target: str) -> dict[str, str]:
    """{file name: text} of the checked Job, for `write_manifests(extra=...)`."""
    check_embedding_job(job, repository)
    return {JOB_FILE: render([embedding_job(settings, job, target)], job_header(settings, job))}
