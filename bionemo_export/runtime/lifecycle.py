"""Keep a started tritonserver serving until it is stopped: the two levels of healing `serve` runs.

A model that stops answering is reloaded alone (runtime/supervisor.py); a tritonserver that dies
(Triton 2.51 aborts on some hostile HTTP bodies, and on a stub dying at the wrong moment) is started
again on the same ports after a pause that doubles with each crash (`RestartPolicy`), and so is one
the supervisor asks to restart (to give back the instances Triton keeps). Too many crashes in a row
end it with `CrashLoopError`. Meanwhile the ports are closed, so health checks say not ready.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bionemo_export.client.triton import ServerUnreachableError, TritonClient
from bionemo_export.errors import UserError
from bionemo_export.model_repository.reader import PUBLIC_SUFFIXES

from .probes import public_models
from .server import TritonServer, TritonStartError
from .supervisor import Supervisor

Log = Callable[[str], None]


class CrashLoopError(UserError, RuntimeError):
    """tritonserver died too often within the restart policy's window: not a passing fault. The
    message says how often; `log_tail` holds the server's last log lines."""

    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(message)
        self.log_tail = log_tail


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

    def __post_init__(self) -> None:
        if self.max_crashes < 1 or self.window <= 0 or self.first_pause < 0 or self.max_pause < self.first_pause:
            raise ValueError(f"RestartPolicy: max_crashes {self.max_crashes} must be at least 1, window "
                             f"{self.window:g} s positive, and 0 <= first_pause {self.first_pause:g} s <= "
                             f"max_pause {self.max_pause:g} s")

    def pause_after_crash(self, now: float) -> float | None:
        """Record a crash at `now`; the seconds to wait before restarting, or None to give up."""
        self.crashes.append(now)
        while self.crashes and now - self.crashes[0] > self.window:
            self.crashes.popleft()
        if len(self.crashes) >= self.max_crashes:
            return None
        return min(self.first_pause * 2 ** (len(self.crashes) - 1), self.max_pause)


@dataclass(frozen=True)
class HealthSettings:
    """How the supervisor watches the served models (serve's --health-* options; see Supervisor)."""

    interval: float = 10.0
    """Seconds between probes of every idle public model; 0: no supervisor."""
    timeout: float = 30.0
    load_timeout: float = 300.0
    stall_timeout: float = 300.0
    leak_limit: int = 8
    stub_memory_limit: int = 1 << 30

    def supervisor(self, server: TritonServer, log: Log) -> Supervisor:
        """A supervisor of `server` (over gRPC: it runs in a thread, where tritonclient's HTTP
        client, gevent, is not at home)."""
        return Supervisor(f"grpc://{server.endpoints.grpc_url}", metrics_url=server.endpoints.metrics_url,
                          interval=self.interval, timeout=self.timeout, load_timeout=self.load_timeout,
                          stall_timeout=self.stall_timeout, server_pid=server.pid, leak_limit=self.leak_limit,
                          stub_memory_limit=self.stub_memory_limit, log=log)


def keep_serving(server: TritonServer, repository: Path | None, health: HealthSettings, policy: RestartPolicy,
                 *, start_timeout: float, log: Log, stop: threading.Event) -> None:
    """Supervise the started `server` and restart it when it dies or its supervisor asks, until
    `stop` is set (then it returns, within half a second, leaving the server to the caller) or an
    exception ends it (the caller's stop signal raised from its handler, or CrashLoopError).
    `repository`: the local folder whose manifest names the public models (None for an s3:// one:
    the server's index names them)."""
    supervisor: Supervisor | None = None
    try:
        while not stop.is_set():
            supervisor = None
            if health.interval > 0 and server.is_running():
                supervisor = start_supervisor(server, repository, health.supervisor(server, log), grace=health.timeout,
                                              log=log)
            while server.is_running() and not (supervisor and supervisor.recycle_reason):
                if stop.wait(0.5):
                    return
            if supervisor is not None:
                supervisor.stop()
            if server.is_running():  # the supervisor asked for a fresh server
                log("serve: restarting tritonserver on the same ports")
                server.stop()
            else:
                exit_code = server.stop()
                pause = policy.pause_after_crash(time.monotonic())
                if pause is None:
                    raise CrashLoopError(f"tritonserver died {len(policy.crashes)} times within "
                                         f"{policy.window / 60:.0f} minutes (last exit code {exit_code}); giving up.",
                                         server.log_tail())
                log(f"serve: tritonserver exited unexpectedly (exit code {exit_code}); restarting it in "
                    f"{pause:g} s on the same ports. Its last log lines:\n{server.log_tail(10)}")
                if stop.wait(pause):
                    return
            restart(server, start_timeout, log)
    finally:
        if supervisor is not None:
            supervisor.stop()


def restart(server: TritonServer, timeout: float, log: Log) -> None:
    """Start `server` again; a start that fails counts as a crash of `keep_serving`'s loop (it sees
    the server not running and pauses before the next try)."""
    start = time.monotonic()
    try:
        server.start(timeout=timeout)
        log(f"serve: tritonserver is ready again ({time.monotonic() - start:.1f} s)")
    except TritonStartError as err:
        log(f"serve: starting tritonserver again failed: {' '.join(str(err).split())[:400]}")


def start_supervisor(server: TritonServer, repository: Path | None, supervisor: Supervisor, grace: float,
                     log: Log) -> Supervisor | None:
    """Start `supervisor` on the public models of the repository's manifest, else the server's. A
    server that dies while it is asked for them (found by a test killing it right after it was
    ready) is no reason to end serving: None, and the loop restarts it as any crash."""
    try:
        with TritonClient(supervisor.url, timeout_s=supervisor.timeout) as client:
            models = public_models(client, repository)
    except ServerUnreachableError:
        deadline = time.monotonic() + grace
        while server.is_running() and time.monotonic() < deadline:
            time.sleep(0.1)
        if server.is_running():  # alive but not answering on its own port: not a crash to retry
            raise
        return None
    if not models:
        log(f"health: no public models (names ending in {', '.join(PUBLIC_SUFFIXES)}) to probe")
        return None
    supervisor.watched = models
    log(f"health: watching {', '.join(models)}: stubs every {supervisor.watch_interval:g} s, idle models probed "
        f"every {supervisor.interval:g} s")
    return supervisor.start()
