"""Serve a model repository with a real tritonserver in the foreground (Ctrl-C or SIGTERM stops it).

Options become a started server handed to runtime/lifecycle.py, which heals it (models reloaded
alone, a dead tritonserver restarted with a doubling pause); too many crashes in a row end `serve`
with exit code 1 and the server's last log lines."""

from __future__ import annotations

import os
import signal
import threading
from datetime import datetime
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from bionemo_export.choices import GoldenCheck
from bionemo_export.cli import NO_CHECK_HELP, check_files, reason
from bionemo_export.runtime import (
    TritonNotFoundError,
    TritonServer,
    TritonStartError,
    find_tritonserver,
)
from bionemo_export.runtime.lifecycle import CrashLoopError, HealthSettings, RestartPolicy, keep_serving
from bionemo_export.runtime.object_storage import S3RepositoryError, is_s3_uri
from bionemo_export.runtime.server import NotAModelRepositoryError, check_model_repository
from bionemo_export.serving.golden import CHECK_ENV

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopServing(BaseException):
    """Raised from the SIGINT/SIGTERM handler so that the server is stopped on the way out. A
    BaseException, as KeyboardInterrupt is: code that catches Exception (a client translating its
    errors, gRPC's internals) must not swallow it and serve on."""


class StopSignals:
    """serve's SIGINT/SIGTERM handler: raises StopServing where the main thread is (a long model
    load or golden check is cut short), and sets `requested`, which `keep_serving`'s loop also
    watches: a stop raised inside code that swallows even BaseException (a callback run from C)
    still ends serving within half a second."""

    def __init__(self) -> None:
        self.requested = threading.Event()

    def __call__(self, signum: int, frame: object) -> None:
        self.requested.set()
        raise StopServing()


def _log(line: str) -> None:
    """One timestamped line, unwrapped (log collectors and tests read it line by line)."""
    typer.echo(f"{datetime.now().isoformat(sep=' ', timespec='seconds')} {line}")


def warn_if_tuned_elsewhere(repository: Path, console: Console) -> None:
    """Say so when `bionemo-export tune` chose the repository's settings on a host with another
    core count (manifest.json's `tuning` record), or `build --precision auto` its precision on a
    CPU of other features (`precision_choice`): they may not suit this one."""
    from bionemo_export.model_repository.manifest import Manifest
    from bionemo_export.tune.record import host_mismatch, precision_mismatch

    try:
        manifest = Manifest.read(repository)
    except (OSError, ValueError):  # no manifest, or not ours: nothing recorded
        return
    for warning in (host_mismatch(manifest), precision_mismatch(manifest)):
        if warning:
            console.print(f"[yellow]warning: {warning}[/yellow]", highlight=False)


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
    tritonserver: str | None = typer.Option(None, help="tritonserver binary to use (default: search, "
                                               "then the one inside nvidia-pytriton)."),
    log_file: Path | None = typer.Option(None, help="Write the server log here (default: a temp file)."),
    response_cache_mb: int = typer.Option(0, help="Size of Triton's local response cache in MiB (0: off)."),
    timeout: float = typer.Option(300.0, help="Seconds to wait for every model to load."),
    health_interval: float = typer.Option(10.0, help="Seconds between health probes of every public model "
                                          "(one tiny real request each); a model that fails is reloaded. 0: off."),
    health_timeout: float = typer.Option(30.0, help="Seconds a health probe may take before it counts as failed."),
    stall_timeout: float = typer.Option(300.0, help="Seconds a model may hold pending requests without finishing "
                                        "one or using CPU before it counts as hung and is reloaded (a model that "
                                        "is merely busy is never reloaded)."),
    max_kept_instances: int = typer.Option(8, help="Once a request has failed on a dead model instance, Triton "
                                           "2.51 keeps that instance (its memory, shared memory and threads) "
                                           "after the model is reloaded; at this many, tritonserver is restarted "
                                           "at an idle moment to give them back. 0: never."),
    stub_memory_mb: int = typer.Option(1024, help="A Python-backend instance whose shared memory grew past this "
                                       "(a large request grows it for good) is reloaded when idle. 0: never."),
    max_restarts: int = typer.Option(5, help="A tritonserver that dies is started again (same ports, doubling "
                                     "pause); this many crashes within 10 minutes end serve with exit code 1."),
    no_check: bool = typer.Option(False, "--no-check", help=NO_CHECK_HELP),
    golden_check: GoldenCheck = typer.Option(
        GoldenCheck.REFUSE, help="Each model that runs a graph answers the build's golden inputs on this host when "
        "it loads; outside the build's tolerance it refuses to load, naming this CPU and the figures. `warn` serves "
        "it anyway, with the warning in the server log (sets BIONEMO_EXPORT_GOLDEN_CHECK for tritonserver)."),
) -> None:
    console = Console()
    if golden_check == GoldenCheck.WARN:  # tritonserver and its Python stubs inherit serve's environment
        os.environ[CHECK_ENV] = golden_check.value
    # Typer's Path would turn s3://bucket into s3:/bucket, hence a string here.
    model_repository = location if is_s3_uri(location) else Path(location).resolve()
    try:
        check_model_repository(model_repository)
    except (NotAModelRepositoryError, S3RepositoryError) as err:
        typer.echo(f"error: {reason(err)}", err=True)
        raise typer.Exit(2) from None
    check_files(model_repository, skip=no_check)
    if isinstance(model_repository, Path):
        warn_if_tuned_elsewhere(model_repository, console)
    try:
        install = find_tritonserver(tritonserver)
    except TritonNotFoundError as err:
        console.print(f"[red]{reason(err)}[/red]")
        raise typer.Exit(2) from None
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
    # and Python then leaves Ctrl-C ignored too. A blocked signal survives exec as well: a launcher
    # that blocked them would leave serve (and the tritonserver it starts) deaf to both.
    stop = StopSignals()
    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    previous_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    health = HealthSettings(interval=health_interval, timeout=health_timeout, load_timeout=timeout,
                            stall_timeout=stall_timeout, leak_limit=max_kept_instances,
                            stub_memory_limit=stub_memory_mb << 20)
    code = None
    try:
        console.print(f"Starting {install.binary} ({install.source}); log: {server.log_file}")
        try:
            server.start(timeout=timeout)
        except TritonStartError as err:
            console.print(f"[red]{err}[/red]", highlight=False)
            raise typer.Exit(1) from None
        _print_status(console, server)
        if isinstance(model_repository, Path):
            _ask_golden_answers(console, model_repository, server, golden_check)
        console.print("Serving. Press Ctrl-C to stop.")
        # The manifest of an s3:// repository is not read; the server's index names the public models.
        local = model_repository if isinstance(model_repository, Path) else None
        keep_serving(server, local, health, RestartPolicy(max_crashes=max(1, max_restarts)), start_timeout=timeout,
                     log=_log, stop=stop.requested)  # returns when a stop's StopServing was swallowed
    except CrashLoopError as err:
        console.print(f"[red]{err}[/red]\n{err.log_tail}", highlight=False)
        raise typer.Exit(1) from None
    except StopServing:
        pass
    finally:
        # A second signal during shutdown must not interrupt the shutdown itself.
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        if stop.requested.is_set():
            console.print("Stopping tritonserver ...")
        code = server.stop()
        server.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
    console.print(f"tritonserver stopped (exit code {code}).")


def _ask_golden_answers(console: Console, repository: Path, server: TritonServer, mode: GoldenCheck) -> None:
    """The golden answers of the models that cannot check themselves (runtime/golden_answers.py):
    outside tolerance, serve stops with exit code 1, or with `--golden-check warn` says so."""
    from bionemo_export.runtime.golden_answers import served_golden_checks

    wrong = [found for found in served_golden_checks(repository, f"grpc://{server.endpoints.grpc_url}")
             if not found.passed]
    for found in wrong:
        console.print(f"[red]{found.refusal()}[/red]", highlight=False)
    if wrong and mode == GoldenCheck.REFUSE:
        raise typer.Exit(1)
    if wrong:
        console.print("[yellow]serving them anyway (--golden-check warn)[/yellow]")


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
