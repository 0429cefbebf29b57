"""Serve a checkpoint the way BioNeMo's dev servers do: a PyTriton process with the PyTorch model
inside, binding the same public models and tensors as a repository built with the same --name
(a development mode, and the baseline that speed claims are measured against); --checkpoint once
per member serves a checkpoint ensemble as `build repo` builds one. Ctrl-C or SIGTERM stops it."""

from __future__ import annotations

from pathlib import Path

import typer


def dev_server(
    checkpoint: list[Path] = typer.Option(..., "--checkpoint", "-c", exists=True, resolve_path=True,
                                          help="Checkpoint (any form `build` reads). Several: a checkpoint ensemble, "
                                          "as `build repo` takes it (once per member, in the same order): N_logits "
                                          "and N_scores answer the members' mean, and each member's on request."),
    family: str | None = typer.Option(None, "--model", "-m",
                                      help="Model family (esm2, esm1, prott5, bert, megamolbart); optional for .nemo."),
    name: str = typer.Option(..., "--name", "-n", help="Model name prefix: NAME_embeddings, NAME_hiddens, "
                             "NAME_decodes, NAME_samplings (the last two for families that decode), NAME_logits, "
                             "NAME_scores, ... as a repository built with --name NAME."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; 0.0.0.0 to accept remote clients."),
    http_port: int = typer.Option(8000, help="HTTP port (0 picks a free one)."),
    grpc_port: int = typer.Option(8001, help="gRPC port (0 picks a free one)."),
    metrics_port: int = typer.Option(8002, help="Prometheus metrics port (0 picks a free one)."),
    max_batch_size: int = typer.Option(10, min=1, help="Rows per request and per batch (BioNeMo's servers: 10)."),
    max_decode_length: int | None = typer.Option(None, min=1, help="Most tokens per decode (default: the "
                                                    "model's limit); match the repository's --max-decode-length."),
) -> None:
    from bionemo_export.dev_server import Ports, load_models, serve
    from bionemo_export.runtime.server import free_ports

    free = iter(free_ports(3, host))
    ports = Ports(host, http_port or next(free), grpc_port or next(free), metrics_port or next(free))
    models = load_models(checkpoint, family, progress=typer.echo, max_decode_length=max_decode_length)

    def ready(names: list[str]) -> None:
        # One line per fact, flushed: scripts and tests wait for "dev server ready".
        typer.echo(f"models: {', '.join(names)}")
        typer.echo(f"dev server ready: http {ports.host}:{ports.http} grpc {ports.host}:{ports.grpc} "
                   f"metrics {ports.host}:{ports.metrics}")

    serve(models, name, ports, max_batch_size=max_batch_size, on_ready=ready)
    typer.echo("dev server stopped.")
