"""The `bionemo-export` command line: help, version, doctor, and `serve` as a real foreground process."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np
import tritonclient.http as httpclient
from typer.testing import CliRunner

from bionemo_export import __version__
from bionemo_export.cli.main import app
from bionemo_export.runtime import free_ports
from tests.helpers.cli import CLI
from tests.helpers.tiny_repository import broken_repository, tiny_repository

runner = CliRunner()


def test_help_lists_every_command_group_with_its_help():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "--debug" in result.output
    for command in ("build", "serve", "verify", "client", "doctor"):
        assert command in result.output
        sub = runner.invoke(app, [command, "--help"])
        assert sub.exit_code == 0 and "Usage" in sub.output


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"bionemo-export {__version__}"


def test_doctor_reports_tritonserver_python_backend_and_perf_analyzer():
    result = runner.invoke(app, ["doctor"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    triton = next(line for line in lines if "tritonserver" in line and "ok" in line)
    assert "2.51.0" in triton
    assert any("backends: python" in line for line in lines)
    assert any("perf_analyzer" in line and "ok" in line and "2.51.0" in line for line in lines)


def _read_until(process: subprocess.Popen[str], marker: str, timeout: float = 120) -> str:
    """Read the CLI's output until a line contains `marker`; return everything read."""
    assert process.stdout is not None, "the process was started without stdout=PIPE"
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        seen.append(line)
        if marker in line:
            return "".join(seen)
    raise AssertionError(f"never printed {marker!r}:\n" + "".join(seen))


def test_serve_runs_in_the_foreground_and_stops_on_sigterm(tmp_path):
    repo = tiny_repository(tmp_path / "models")
    http, grpc, metrics = free_ports(3)
    process = subprocess.Popen(
        [*CLI, "serve", str(repo), "--http-port", str(http), "--grpc-port", str(grpc),
         "--metrics-port", str(metrics), "--log-file", str(tmp_path / "server.log")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"},
    )
    try:
        banner = _read_until(process, "Serving.")
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
        x = np.arange(4, dtype=np.float32)[None, :]
        inp = httpclient.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(x)
        y = client.infer("affine", [inp]).as_numpy("y")
        assert y is not None, "affine answered without output y"
        np.testing.assert_array_equal(y, 2 * x + 1)
        client.close()
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=60)
        output = banner + rest
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert f"http://127.0.0.1:{http}" in output
    assert f"grpc://127.0.0.1:{grpc}" in output
    assert "affine" in output and "READY" in output
    assert "tritonserver stopped (exit code 0)" in output


def test_serve_explains_a_model_that_fails_to_load(tmp_path):
    repo = broken_repository(tmp_path / "models")
    http, grpc, metrics = free_ports(3)
    result = subprocess.run(
        [*CLI, "serve", str(repo), "--http-port", str(http), "--grpc-port", str(grpc),
         "--metrics-port", str(metrics)],
        capture_output=True, text=True, timeout=180, env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 1
    assert "failed to load 'broken'" in result.stdout
    assert "deliberately broken model" in result.stdout


def test_serve_names_a_missing_repository(tmp_path):
    result = runner.invoke(app, ["serve", str(tmp_path / "missing")], env={"COLUMNS": "200"})
    assert result.exit_code != 0
    assert "does not exist" in result.output
