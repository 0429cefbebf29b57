"""Write deployment manifests that serve a generated model repository past one machine."""

from __future__ import annotations

from pathlib import Path

import typer

from bionemo_export.choices import DeployTarget

app = typer.Typer(help=__doc__, no_args_is_help=True)


@app.command("k8s")
def k8s(
    repository: Path = typer.Argument(..., help="The model repository folder (built by `bionemo-export build repo`): "
                                      "its model folders decide what Triton loads."),
    image: str = typer.Option(..., help="Container image with tritonserver, e.g. "
                              "nvcr.io/nvidia/tritonserver:24.10-py3."),
    replicas: int = typer.Option(1, help="Replicas to run (the autoscalers' minimum)."),
    max_replicas: int | None = typer.Option(None, help="The autoscalers' maximum (default: --replicas, a fixed size)."),
    gpus: int = typer.Option(0, help="GPUs per replica (nvidia.com/gpu limits); 0: CPU only."),
    storage: str | None = typer.Option(None, "--storage-uri", help="Where the cluster reads the repository: "
                                       "s3://bucket/path, gs://bucket/path or pvc://claim/path. Required for KServe; "
                                       "without it the plain Deployment mounts a PersistentVolumeClaim written "
                                       "beside it."),
    out: Path = typer.Option(Path("k8s"), help="Folder to write the manifests into."),
    name: str | None = typer.Option(None, help="Name of the Kubernetes objects (default: the repository's --name)."),
    target: DeployTarget = typer.Option(DeployTarget.ALL, help="all: KServe and plain Kubernetes; kserve: the "
                                        "InferenceService only; plain: Deployment + Service + HorizontalPodAutoscaler "
                                        "only."),
    cpu: str = typer.Option("2", help="CPU request per replica (the autoscaler scales on its use)."),
    memory: str = typer.Option("8Gi", help="Memory request and limit per replica (/dev/shm counts against it)."),
    shm_size: str = typer.Option("1Gi", help="Size of the in-memory /dev/shm the Python backend exchanges tensors "
                                 "through (a container's default 64 MB is too small)."),
    embed_input: str | None = typer.Option(None, help="Also write an embedding Job (embedding-job.yaml): the "
                                           "dataset in object storage, s3://bucket/path/uniref50.fasta.gz."),
    embed_output: str | None = typer.Option(None, help="Embedding Job: the s3:// folder for its shards "
                                            "(shard I in <folder>/shard-I/)."),
    embed_model: str | None = typer.Option(None, help="Embedding Job: the public model its pods call "
                                           "(default: the repository's N_embeddings model)."),
    embed_include: str | None = typer.Option(None, help="Embedding Job: what its pods store of each record "
                                             "(client encode --include: mean, bos, max, per_tok, contacts)."),
    embed_shards: int = typer.Option(8, help="Embedding Job: its pods (completions), one shard of the input each."),
    embed_parallelism: int | None = typer.Option(None, help="Embedding Job: pods at once (default: 2 per "
                                                 "server replica, at most --embed-shards)."),
    client_image: str | None = typer.Option(None, help="Embedding Job: an image with bionemo-export[jobs] "
                                            "installed (the client only; no torch)."),
) -> None:
    """Kubernetes manifests for a repository: a KServe InferenceService (Triton runtime) and a plain
    Deployment + Service + HorizontalPodAutoscaler; readiness and liveness on Triton's health
    endpoints, metrics port annotated for Prometheus."""
    from bionemo_export.deploy.embedding_job import EmbeddingJobSettings, embedding_job_file
    from bionemo_export.deploy.kubernetes import (
        DeploySettings,
        default_name,
        parse_storage_uri,
        read_repository,
        write_manifests,
    )
    from bionemo_export.model_repository.backends import deployment_note

    facts = read_repository(repository)
    embedding = None
    if embed_input is not None or embed_output is not None:
        missing = [option for option, value in (("--embed-input", embed_input), ("--embed-output", embed_output),
                                                ("--client-image", client_image)) if value is None]
        if missing:
            raise typer.BadParameter(f"an embedding Job also needs {', '.join(missing)}")
        model = embed_model or next((m for m in facts.public_models if m.endswith("_embeddings")), "")
        assert embed_input is not None and embed_output is not None and client_image is not None  # checked above
        embedding = EmbeddingJobSettings(input=embed_input, output=embed_output, model=model,
                                         client_image=client_image, shards=embed_shards, include=embed_include,
                                         parallelism=embed_parallelism)
    settings = DeploySettings(
        name=name or default_name(facts), image=image, replicas=replicas, max_replicas=max_replicas, gpus=gpus,
        storage=parse_storage_uri(storage) if storage else None, cpu=cpu, memory=memory, shm_size=shm_size)
    extra = embedding_job_file(facts, settings, embedding, target) if embedding is not None else None
    for path in write_manifests(facts, settings, out, target, extra):
        typer.echo(f"wrote {path}")
    typer.echo(f"models loaded: {', '.join(facts.models)} (public: {', '.join(facts.public_models) or 'none'})")
    note = deployment_note(facts.backend)
    if note:
        typer.echo(f"note: {note}")
