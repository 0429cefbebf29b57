"""`serve` brings back a tritonserver that died, gives up on one that keeps dying, and leaves nothing
in the temporary folder.

Each test runs the real `bionemo-export serve` on the hand-made tiny repository (two Python models
that load in a second). The crash is a real one: Triton 2.51 aborts on an HTTP inference body of
~100 KB whose `data` array is nested 50,000 deep (docs/reference/platform.md). Only processes the tests started
are signalled.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from typing import cast

import numpy as np
import pytest

from bionemo_export.client.triton import TritonClient
from bionemo_export.runtime import TritonServer, free_ports
from tests.helpers import serve_process as sp


def _affine(http: int) -> list[float]:
    with TritonClient(f"http://127.0.0.1:{http}", timeout_s=10) as client:
        return client.infer("affine", {"x": np.array([[1.0, 2.0]], dtype=np.float32)})["y"][0].tolist()


def _send_deeply_nested_json(http: int) -> None:
    """The request that crashes Triton 2.51: a `data` array nested 50,000 deep (~100 KB)."""
    body = ('{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":' + "[" * 50_000 + "1"
            + "]" * 50_000 + "}]}").encode()
    with socket.create_connection(("127.0.0.1", http), timeout=5) as sock:
        sock.sendall(b"POST /v2/models/affine/infer HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        try:
            sock.recv(1024)
        except OSError:  # the server died with the connection open
            pass


def test_a_crashed_tritonserver_is_started_again_on_the_same_ports(tiny_repo, tmp_path):
    """Finding: one hostile request killed tritonserver and `serve` exited 1, a full outage behind a
    public port. Now serve logs it, waits, and starts the server again on the same ports; health
    says not ready meanwhile; the models answer again."""
    serve = sp.serve(tiny_repo, tmp_path)
    try:
        first = sp.tritonserver_of(serve.process.pid)
        assert _affine(serve.http) == [3.0, 5.0]
        _send_deeply_nested_json(serve.http)
        deadline = time.monotonic() + 30
        while sp.alive(first):
            assert time.monotonic() < deadline, "the hostile request no longer crashes Triton: pick another crash"
            time.sleep(0.05)
        not_ready = not sp.server_ready(serve.http)
        serve.wait_for("serve: tritonserver is ready again", timeout=120)
        assert not_ready, "health said ready with the server dead"
        assert serve.process.poll() is None
        second = sp.tritonserver_of(serve.process.pid)
        assert second != first
        assert _affine(serve.http) == [3.0, 5.0]
        assert "serve: tritonserver exited unexpectedly" in serve.text()
    finally:
        serve.stop()
    assert serve.process.returncode == 0, serve.text()


def test_serve_gives_up_when_tritonserver_keeps_dying(tiny_repo, tmp_path):
    """Repeated crashes are no passing fault: after --max-restarts crashes within 10 minutes serve
    exits 1 and prints the server's last log lines."""
    serve = sp.serve(tiny_repo, tmp_path, "--max-restarts", "2")
    try:
        server = sp.tritonserver_of(serve.process.pid)
        os.kill(server, signal.SIGKILL)
        serve.wait_for("serve: tritonserver is ready again", timeout=120)
        os.kill(sp.tritonserver_of(serve.process.pid), signal.SIGKILL)
        code = serve.process.wait(120)
    finally:
        serve.stop()
    text = serve.text()
    assert code == 1, text
    assert "tritonserver died 2 times within 10 minutes" in text and "giving up" in text
    assert "Started HTTPService" in text or "successfully loaded" in text  # the server's own log lines


def test_serve_leaves_nothing_in_the_temporary_folder(tiny_repo, tmp_path):
    """Finding: every serve run left a /tmp/bionemo-export-triton-* folder (74 after a day of tests)."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    http, grpc, metrics = free_ports(3)
    output = tmp_path / "serve.out"
    with open(output, "w") as out:
        process = subprocess.Popen(
            [*sp.CLI, "serve", str(tiny_repo), "--http-port", str(http), "--grpc-port", str(grpc),
             "--metrics-port", str(metrics)], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "TMPDIR": str(temporary)})
    try:
        deadline = time.monotonic() + 120
        while "Serving." not in output.read_text():
            assert process.poll() is None and time.monotonic() < deadline, output.read_text()
            time.sleep(0.1)
        assert list(temporary.iterdir()), "serve keeps its log in the temporary folder while it runs"
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, output.read_text()
    finally:
        if process.poll() is None:
            process.kill()
    assert not list(temporary.iterdir()), list(temporary.iterdir())


class _DeadServer:
    """A TritonServer whose process has just died (what `start_supervisor` sees after a SIGKILL)."""

    def is_running(self) -> bool:
        return False


class _LiveButDeafServer:
    def is_running(self) -> bool:
        return True


def test_a_server_that_dies_while_the_supervisor_starts_is_a_crash_not_an_error():
    """Finding (CI): killed right after it was ready, the server reset the supervisor's first
    request and serve exited 1 instead of restarting it. Unreachable and dead: no supervisor, the
    loop restarts the server; unreachable but alive: still an error."""
    from bionemo_export.client.triton import ServerUnreachableError
    from bionemo_export.runtime.lifecycle import start_supervisor
    from bionemo_export.runtime.supervisor import Supervisor

    (port,) = free_ports(1)  # nothing listens there
    supervisor = Supervisor(f"grpc://127.0.0.1:{port}", timeout=2)
    # start_supervisor asks its server only whether it is running: these two answer that alone
    dead, deaf = cast(TritonServer, _DeadServer()), cast(TritonServer, _LiveButDeafServer())
    assert start_supervisor(dead, None, supervisor, grace=1, log=print) is None
    with pytest.raises(ServerUnreachableError):
        start_supervisor(deaf, None, supervisor, grace=0.2, log=print)


def test_a_stop_signal_ends_serving_even_where_its_exception_is_swallowed():
    """Finding (CI, once in ten runs of test_serve_leaves_nothing_in_the_temporary_folder): serve,
    sent SIGTERM just after "Serving.", had not exited 60 s later. The handler raised an Exception
    subclass, and the main thread was then in gRPC calls (the supervisor asking for the models),
    where code that catches Exception, or a Python callback run from C, can swallow it. The stop is
    a BaseException now, and the handler also sets an event that keep_serving's loop watches."""
    from bionemo_export.cli.serve import StopServing, StopSignals
    from bionemo_export.runtime.lifecycle import HealthSettings, RestartPolicy, keep_serving

    stop = StopSignals()
    with pytest.raises(StopServing):
        try:
            stop(signal.SIGTERM, None)
        except Exception:  # what a client translating its errors does
            pass
    assert stop.requested.is_set()

    swallowed = StopSignals()
    # The clock starts before the timer does: a run that read it after starting the timer measured
    # 0.292 s for a 0.3 s wait.
    started = time.monotonic()
    threading.Timer(0.3, swallowed.requested.set).start()  # the signal came; its exception was lost
    keep_serving(cast(TritonServer, _LiveButDeafServer()), None, HealthSettings(interval=0), RestartPolicy(),
                 start_timeout=1, log=print, stop=swallowed.requested)
    waited = time.monotonic() - started
    assert swallowed.requested.is_set(), f"keep_serving returned after {waited:.3f} s, before the stop came"
    assert waited < 5
