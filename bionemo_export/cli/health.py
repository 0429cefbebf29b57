"""Check that a server's public models answer: one tiny real request each, one line per model;
exit code 0 when every model answers, 1 otherwise (a Kubernetes liveness/readiness probe). A model
whose queue turned the probe away (admission control) is alive and saturated: `busy`, exit 0."""

from __future__ import annotations

import typer

from bionemo_export.client.triton import DEFAULT_URL


def health(
    url: str = typer.Argument(DEFAULT_URL, help="The server: http://host:port or grpc://host:port."),
    models: list[str] | None = typer.Option(None, "--model", "-m", help="A model to probe; repeat for more "
                                               "(default: every public model the server lists)."),
    timeout: float = typer.Option(10.0, help="Seconds each request may take."),
) -> None:
    """Probe the public models (or those named) with one tiny real request each."""
    from bionemo_export.client.triton import TritonClient
    from bionemo_export.model_repository.reader import PUBLIC_SUFFIXES
    from bionemo_export.runtime.probes import probe_model, public_models

    try:
        client = TritonClient(url, timeout_s=timeout)
    except ValueError as err:  # a URL scheme other than http/grpc
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    with client:
        try:
            names = models or public_models(client)
        except Exception as err:  # refused, timed out, not a Triton server
            typer.echo(f"FAIL  {url}: cannot list the models: {' '.join(str(err).split())}")
            raise typer.Exit(1) from None
        if not names:
            typer.echo(f"FAIL  {url}: no public model (a name ending in {', '.join(PUBLIC_SUFFIXES)}); "
                       "name one with --model")
            raise typer.Exit(1)
        healthy = True
        for name in names:
            result = probe_model(client, name)
            typer.echo(result.line())
            healthy = healthy and (result.ok or result.turned_away)
    raise typer.Exit(0 if healthy else 1)
