"""Serve a model repository with a real tritonserver in the foreground (Ctrl-C or SIGTERM stops it)."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from bionemo_export.runtime import (
    TritonNotFoundError,
    TritonServer,
    TritonStartError,
    find_tritonserver,
)


class _Stop(Exception):
    """Raised from the SIGTERM handler so that the server is stopped on the way out."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop()


def serve(
    model_repository: Path = typer.Argument(..., help="The model repository folder to serve.",
                                            exists=True, file_okay=False, resolve_path=True),
    http_port: int = typer.Option(8000, help="HTTP port (0 picks a free one)."),
    grpc_port: int = typer.Option(8001, help="gRPC port (0 picks a free one)."),
    metrics_port: int = typer.Option(8002, help="Prometheus metrics port (0 picks a free one)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; 0.0.0.0 to accept remote clients."),
    tritonserver: Optional[str] = typer.Option(None, help="tritonserver binary to use (default: search, "
                                               "then the one inside nvidia-pytriton)."),
    log_file: Optional[Path] = typer.Option(None, help="Write the server log here (default: a temp file)."),
    response_cache_mb: int = typer.Option(0, help="Size of Triton's local response cache in MiB (0: off)."),
    timeout: float = typer.Option(300.0, help="Seconds to wait for every model to load."),
) -> None:
    console = Console()
    try:
        install = find_tritonserver(tritonserver)
    except TritonNotFoundError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2)
    server = TritonServer(
        model_repository,
        install=install,
        host=host,
        http_port=http_port or None,
        grpc_port=grpc_port or None,
        metrics_port=metrics_port or None,
        log_file=log_file,
        response_cache_bytes=response_cache_mb * 1024 * 1024 or None,
    )
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    try:
        console.print(f"Starting {install.binary} ({install.source}); log: {server.log_file}")
        try:
            server.start(timeout=timeout)
        except TritonStartError as err:
            console.print(f"[red]{err}[/red]", highlight=False)
            raise typer.Exit(1)
        _print_status(console, server)
        console.print("Serving. Press Ctrl-C to stop.")
        while server.is_running():
            time.sleep(0.5)
        console.print(f"[red]tritonserver exited unexpectedly.[/red]\n{server.log_tail()}", highlight=False)
        raise typer.Exit(1)
    except (KeyboardInterrupt, _Stop):
        console.print("Stopping tritonserver ...")
    finally:
        # A second SIGTERM during shutdown must not interrupt the shutdown itself.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        code = server.stop()
        signal.signal(signal.SIGTERM, previous)
    console.print(f"tritonserver stopped (exit code {code}).")


def _print_status(console: Console, server: TritonServer) -> None:
    meta = server.metadata()
    ep = server.endpoints
    console.print(f"Triton Inference Server {meta.get('version')} is ready")
    console.print(f"  HTTP    http://{ep.http_url}")
    console.print(f"  gRPC    grpc://{ep.grpc_url}")
    console.print(f"  metrics {ep.metrics_url}")
    table = Table(title="models")
    for column in ("model", "version", "state", "reason"):
        table.add_column(column)
    for model in server.model_states():
        table.add_row(model.get("name", ""), str(model.get("version", "")), model.get("state", ""),
                      model.get("reason", ""))
    console.print(table)
