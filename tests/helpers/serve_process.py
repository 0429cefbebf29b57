"""A real `bionemo-export serve` process for tests, and the processes it starts, found through /proc.

Tests kill only processes they started: the serve process, and the server and stubs it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bionemo_export import procfs
from bionemo_export.runtime import free_ports
from tests.helpers.cli import CLI

# -- processes, through /proc -------------------------------------------------------------------

def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line with its arguments joined by spaces) of the live children of `pid`."""
    found = []
    for child in procfs.children(pid):
        arguments = procfs.command_line(child.pid)
        if arguments is not None and not child.zombie:
            found.append((child.pid, " ".join(arguments)))
    return found


alive = procfs.alive
"""Running (a zombie waiting for a reaper that never comes counts as gone)."""


def tritonserver_of(serve_pid: int) -> int:
    servers = [pid for pid, cmdline in children(serve_pid) if "tritonserver " in cmdline + " "]
    assert len(servers) == 1, children(serve_pid)
    return servers[0]


def stubs(server_pid: int, model: str = "") -> list[int]:
    """The server's Python-backend stubs (of `model`: the stub's command line names the model file
    and the instance, <model>_<group>_<index>)."""
    return [pid for pid, cmdline in children(server_pid)
            if "triton_python_backend_stub" in cmdline and (not model or f"/{model}/1/model.py" in cmdline)]


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.2)
    return [pid for pid in pids if alive(pid)]


def shm_prefix(server_pid: int) -> str:
    option = next(arg for arg in procfs.command_line(server_pid) or () if "shm-region-prefix-name=" in arg)
    return option.split("shm-region-prefix-name=", 1)[1]


# -- serve as a real process --------------------------------------------------------------------

def model_ready(http: int, model: str) -> bool:
    """Whether the model's ready endpoint answers 200."""
    return _answers_ok(f"http://127.0.0.1:{http}/v2/models/{model}/ready")


def server_ready(http: int) -> bool:
    """Whether the server's readiness endpoint answers 200 (every model it loads is ready)."""
    return _answers_ok(f"http://127.0.0.1:{http}/v2/health/ready")


def _answers_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class Serve:
    process: subprocess.Popen
    output: Path
    http: int
    grpc: int

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def wait_for(self, *markers: str, timeout: float = 180, since: int = 0) -> str:
        """Wait until the output (from character `since` on) holds one of `markers`; return it."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()[since:]
            found = next((marker for marker in markers if marker in text), None)
            if found is not None:
                return found
            assert self.process.poll() is None, f"serve exited with {self.process.returncode}:\n{self.text()}"
            assert time.monotonic() < deadline, f"serve never printed any of {markers!r}:\n{self.text()}"
            time.sleep(0.1)

    def settle(self, model: str, timeout: float = 180, quiet: float = 3.0) -> None:
        """Wait until every tritonserver restart serve began has ended, `model` says ready and
        serve has printed nothing for `quiet` seconds (a reload the supervisor started is over):
        tests sharing one serve process each start from a server at rest, whatever the one before
        left behind (measured in CI: a restart begun during one test refused the next one's first
        request)."""
        begun = ("serve: restarting tritonserver on the same ports", "serve: tritonserver exited unexpectedly")
        ended = ("serve: tritonserver is ready again", "serve: starting tritonserver again failed")
        deadline = time.monotonic() + timeout
        last, since = self.text(), time.monotonic()
        while True:
            assert self.process.poll() is None, f"serve exited with {self.process.returncode}:\n{self.text()}"
            text = self.text()
            if text != last:
                last, since = text, time.monotonic()
            restarting = sum(map(text.count, begun)) > sum(map(text.count, ended))
            if not restarting and time.monotonic() - since >= quiet and model_ready(self.http, model):
                return
            assert time.monotonic() < deadline, f"serve never settled within {timeout:g} s:\n{text}"
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL for serve and (by the parent-death signal) its server."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def serve(repo: Path, work: Path, *args: str, launcher: Sequence[str] = ()) -> Serve:
    """`bionemo-export serve repo *args` once it says "Serving.". `launcher`: a command that execs
    the rest (to start serve with inherited signal settings); not a preexec_fn, which would fork()
    this test process, gRPC threads and all (runtime/server.py's dying_with_parent says why)."""
    http, grpc, metrics = free_ports(3)
    output = work / f"serve-{http}.out"
    with open(output, "w") as out:
        process = subprocess.Popen(
            [*launcher, *CLI, "serve", str(repo), "--http-port", str(http), "--grpc-port", str(grpc),
             "--metrics-port", str(metrics), "--log-file", str(work / f"tritonserver-{http}.log"), *args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
            env={**os.environ, "COLUMNS": "200"},
        )
    served = Serve(process, output, http, grpc)
    try:
        served.wait_for("Serving.")
    except BaseException:
        served.stop()
        raise
    return served
