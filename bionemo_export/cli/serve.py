"""Serve a model repository with a real tritonserver in the foreground (Ctrl-C or SIGTERM stops it).

Two levels of healing: a model that stops answering is reloaded alone (runtime/supervisor.py), and
a tritonserver that dies (Triton 2.51 aborts on some hostile HTTP bodies, and on a stub dying at the
wrong moment) is started again on the same ports after a pause that doubles with each crash
(`RestartPolicy`); too many crashes in a row end `serve` with exit code 1 and the server's last log
lines. Meanwhile the ports are closed, so health checks say not ready."""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from bionemo_export.choices import GoldenCheck
from bionemo_export.cli import NO_CHECK_HELP, check_files, reason
from bionemo_export.client.triton import ServerUnreachableError
from bionemo_export.runtime import (
    TritonNotFoundError,
    TritonServer,
    TritonStartError,
    find_tritonserver,
)
from bionemo_export.runtime.object_storage import S3RepositoryError, is_s3_uri
from bionemo_export.runtime.server import NotAModelRepositoryError, check_model_repository
from bionemo_export.runtime.supervisor import PUBLIC_SUFFIXES, ControlClient, Supervisor, public_models
from bionemo_export.serving.golden import CHECK_ENV

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Stop(Exception):
    """Raised from the SIGINT/SIGTERM handler so that the server is stopped on the way out."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop()


@dataclass
class RestartPolicy:
    """When a crashed tritonserver is started again: after `first_pause` seconds, doubling with each
    crash up to `max_pause`, unless `max_crashes` crashes fell within the last `window` seconds
    (then it is not a passing fault: give up)."""

    max_crashes: int = 5
    window: float = 600.0
    first_pause: float = 1.0
    max_pause: float = 30.0
    crashes: deque = field(default_factory=deque)

    def pause_after_crash(self, now: float) -> float | None:
        """Record a crash at `now`; the seconds to wait before restarting, or None to give up."""
        self.crashes.append(now)
        while self.crashes and now - self.crashes[0] > self.window:
            self.crashes.popleft()
        if len(self.crashes) >= self.max_crashes:
            return None
        return min(self.first_pause * 2 ** (len(self.crashes) - 1), self.max_pause)


def _log(line: str) -> None:
    """One timestamped line, unwrapped (log collectors and tests read it line by line)."""
    typer.echo(f"{datetime.now().isoformat(sep=' ', timespec='seconds')} {line}")


def warn_if_tuned_elsewhere(repository: Path, console: Console) -> None:
    """Say so when `bionemo-export tune` chose the repository's settings on a host with another
    core count (manifest.json's `tuning` record): they may not suit this one."""
    from bionemo_export.model_repository.manifest import Manifest
    from bionemo_export.tune.record import host_mismatch

    try:
        warning = host_mismatch(Manifest.read(repository))
    except (OSError, ValueError):  # no manifest, or not ours: nothing recorded
        return
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
    # and Python then leaves Ctrl-C ignored too.
    previous = {signum: signal.signal(signum, _raise_stop) for signum in STOP_SIGNALS}
    supervisor: Supervisor | None = None
    policy = RestartPolicy(max_crashes=max(1, max_restarts))
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
        while True:
            supervisor = None
            if health_interval > 0 and server.is_running():
                # The manifest of an s3:// repository is not read; the server's index names the public models.
                local = model_repository if isinstance(model_repository, Path) else None
                supervisor = _start_supervisor(server, local, Supervisor(
                    f"grpc://{server.endpoints.grpc_url}", metrics_url=server.endpoints.metrics_url,
                    interval=health_interval, timeout=health_timeout, load_timeout=timeout,
                    stall_timeout=stall_timeout, server_pid=server.pid, leak_limit=max_kept_instances,
                    stub_memory_limit=stub_memory_mb << 20, log=_log), grace=health_timeout)
            while server.is_running() and not (supervisor and supervisor.recycle_reason):
                time.sleep(0.5)
            if supervisor is not None:
                supervisor.stop()
            if server.is_running():  # the supervisor asked for a fresh server
                _log("serve: restarting tritonserver on the same ports")
                server.stop()
            else:
                exit_code = server.stop()
                pause = policy.pause_after_crash(time.monotonic())
                if pause is None:
                    console.print(f"[red]tritonserver died {len(policy.crashes)} times within "
                                  f"{policy.window / 60:.0f} minutes (last exit code {exit_code}); giving up."
                                  f"[/red]\n{server.log_tail()}", highlight=False)
                    raise typer.Exit(1)
                _log(f"serve: tritonserver exited unexpectedly (exit code {exit_code}); restarting it in "
                     f"{pause:g} s on the same ports. Its last log lines:\n{server.log_tail(10)}")
                time.sleep(pause)
            _restart(server, timeout)
    except _Stop:
        console.print("Stopping tritonserver ...")
    finally:
        # A second signal during shutdown must not interrupt the shutdown itself.
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        if supervisor is not None:
            supervisor.stop()
        code = server.stop()
        server.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    console.print(f"tritonserver stopped (exit code {code}).")


def _restart(server: TritonServer, timeout: float) -> None:
    """Start `server` again; a start that fails counts as a crash of the loop above (it sees the
    server not running and pauses before the next try)."""
    start = time.monotonic()
    try:
        server.start(timeout=timeout)
        _log(f"serve: tritonserver is ready again ({time.monotonic() - start:.1f} s)")
    except TritonStartError as err:
        _log(f"serve: starting tritonserver again failed: {' '.join(str(err).split())[:400]}")


def _start_supervisor(server: TritonServer, repository: Path | None, supervisor: Supervisor,
                      grace: float) -> Supervisor | None:
    """Start `supervisor` (gRPC: it runs in a thread, where tritonclient's HTTP client, gevent, is
    not at home) on the public models of the repository's manifest, else the server's. A server
    that dies while it is asked for them (found by a test killing it right after it was ready) is
    no reason to end serve: None, and the loop restarts it as any crash."""
    try:
        with ControlClient(supervisor.url, timeout_s=supervisor.timeout) as client:
            models = public_models(client, repository)
    except ServerUnreachableError:
        deadline = time.monotonic() + grace
        while server.is_running() and time.monotonic() < deadline:
            time.sleep(0.1)
        if server.is_running():  # alive but not answering on its own port: not a crash to retry
            raise
        return None
    if not models:
        _log(f"health: no public models (names ending in {', '.join(PUBLIC_SUFFIXES)}) to probe")
        return None
    supervisor.watched = models
    _log(f"health: watching {', '.join(models)}: stubs every {supervisor.watch_interval:g} s, idle models probed "
         f"every {supervisor.interval:g} s")
    return supervisor.start()


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
