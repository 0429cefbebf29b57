"""Serve a model repository with a real tritonserver in the foreground (Ctrl-C or SIGTERM stops it);
public models that stop answering are reloaded."""

from __future__ import annotations

import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from bionemo_export.cli import NO_CHECK_HELP, check_files
from bionemo_export.runtime import (
    TritonNotFoundError,
    TritonServer,
    TritonStartError,
    find_tritonserver,
)
from bionemo_export.runtime.object_storage import S3RepositoryError, is_s3_uri
from bionemo_export.runtime.server import NotAModelRepositoryError, check_model_repository
from bionemo_export.runtime.supervisor import ControlClient, Supervisor, public_models

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Stop(Exception):
    """Raised from the SIGINT/SIGTERM handler so that the server is stopped on the way out."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop()


def _log(line: str) -> None:
    """One timestamped line, unwrapped (log collectors and tests read it line by line)."""
    typer.echo(f"{datetime.now().isoformat(sep=' ', timespec='seconds')} {line}")


def serve(
    location: str = typer.Argument(..., metavar="MODEL_REPOSITORY",
                                   help="The model repository: a local folder, or an s3:// location that "
                                   "tritonserver reads itself (s3://bucket/path on AWS, s3://host:port/bucket/path "
                                   "on another S3-compatible store; credentials from AWS_ACCESS_KEY_ID, "
                                   "AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION)."),
    http_port: int = typer.Option(8000, help="HTTP port (0 picks a free one)."),
    grpc_port: int = typer.Option(8001, help="gRPC port (0 picks a free one)."),
    metrics_port: int = typer.Option(8002, help="Prometheus metrics port (0 picks a free one)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; 0.0.0.0 to accept remote clients."),
    tritonserver: Optional[str] = typer.Option(None, help="tritonserver binary to use (default: search, "
                                               "then the one inside nvidia-pytriton)."),
    log_file: Optional[Path] = typer.Option(None, help="Write the server log here (default: a temp file)."),
    response_cache_mb: int = typer.Option(0, help="Size of Triton's local response cache in MiB (0: off)."),
    timeout: float = typer.Option(300.0, help="Seconds to wait for every model to load."),
    health_interval: float = typer.Option(10.0, help="Seconds between health probes of every public model "
                                          "(one tiny real request each); a model that fails is reloaded. 0: off."),
    health_timeout: float = typer.Option(30.0, help="Seconds a health probe may take before it counts as failed."),
    no_check: bool = typer.Option(False, "--no-check", help=NO_CHECK_HELP),
) -> None:
    console = Console()
    # Typer's Path would turn s3://bucket into s3:/bucket, hence a string here.
    model_repository = location if is_s3_uri(location) else Path(location).resolve()
    try:
        check_model_repository(model_repository)
    except (NotAModelRepositoryError, S3RepositoryError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2)
    check_files(model_repository, skip=no_check)
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
    # Our own handlers whatever we inherited: a script's `serve &` starts us with SIGINT ignored,
    # and Python then leaves Ctrl-C ignored too.
    previous = {signum: signal.signal(signum, _raise_stop) for signum in STOP_SIGNALS}
    supervisor: Supervisor | None = None
    code = None
    try:
        console.print(f"Starting {install.binary} ({install.source}); log: {server.log_file}")
        try:
            server.start(timeout=timeout)
        except TritonStartError as err:
            console.print(f"[red]{err}[/red]", highlight=False)
            raise typer.Exit(1)
        _print_status(console, server)
        if health_interval > 0:
            # The manifest of an s3:// repository is not read; the server's index names the public models.
            local = model_repository if isinstance(model_repository, Path) else None
            supervisor = _start_supervisor(server, local, health_interval, health_timeout, timeout)
        console.print("Serving. Press Ctrl-C to stop.")
        while server.is_running():
            time.sleep(0.5)
        console.print(f"[red]tritonserver exited unexpectedly.[/red]\n{server.log_tail()}", highlight=False)
        raise typer.Exit(1)
    except _Stop:
        console.print("Stopping tritonserver ...")
    finally:
        # A second signal during shutdown must not interrupt the shutdown itself.
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        if supervisor is not None:
            supervisor.stop()
        code = server.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    console.print(f"tritonserver stopped (exit code {code}).")


def _start_supervisor(server: TritonServer, repository: Path | None, interval: float, timeout: float,
                      load_timeout: float) -> Supervisor | None:
    """Probe the public models every `interval` seconds and reload the ones that stop answering."""
    # gRPC: the supervisor runs in a thread, where tritonclient's HTTP client (gevent) is not at home.
    url = f"grpc://{server.endpoints.grpc_url}"
    with ControlClient(url, timeout_s=timeout) as client:
        models = public_models(client, repository)
    if not models:
        _log("health: no public models (names ending in _embeddings, _hiddens, _decodes, _samplings) to probe")
        return None
    _log(f"health: probing {', '.join(models)} every {interval:g} s")
    return Supervisor(url, models, interval=interval, timeout=timeout, load_timeout=load_timeout,
                      server_pid=server.pid, log=_log).start()


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
