"""The runtime layer against the real embedded tritonserver: serve, infer (HTTP, gRPC), stop, fail readably."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from bionemo_export import procfs
from bionemo_export.client.triton import ModelNotServedError, TritonClient
from bionemo_export.runtime import TritonServer, TritonStartError, find_perf_analyzer, probe_server
from tests.helpers.tiny_repository import broken_repository, tiny_repository


def _group_members(pgid: int) -> list[int]:
    """PIDs whose process group is `pgid` (the server and the Python-backend stubs it spawned)."""
    return [stat.pid for stat in procfs.processes() if stat.pgrp == pgid and not stat.zombie]


def output(result: httpclient.InferResult | grpcclient.InferResult | None, name: str) -> np.ndarray:
    """Output `name` of a tritonclient result, checked to be there."""
    assert result is not None, "tritonclient returned no result"
    array = result.as_numpy(name)
    assert array is not None, f"the response has no output {name!r}"
    return array


def test_http_inference_returns_the_right_numbers(tiny_server):
    client = httpclient.InferenceServerClient(tiny_server.endpoints.http_url)
    x = np.array([[0.0, 1.5, -2.0], [3.0, 4.0, 5.0]], dtype=np.float32)
    inp = httpclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = output(client.infer("affine", [inp]), "y")
    np.testing.assert_array_equal(result, 2 * x + 1)


def test_grpc_inference_returns_the_right_numbers_and_strings(tiny_server):
    client = grpcclient.InferenceServerClient(tiny_server.endpoints.grpc_url)
    x = np.linspace(-1, 1, 7, dtype=np.float32)[None, :]
    inp = grpcclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(output(client.infer("affine", [inp]), "y"), 2 * x + 1)

    words = np.array([[b"MKTAYIAK"], ["ΑΒΓ".encode()]], dtype=np.object_)
    sinp = grpcclient.InferInput("sequences", list(words.shape), "BYTES")
    sinp.set_data_from_numpy(words)
    out = output(client.infer("reverse", [sinp]), "reversed")
    assert [row[0].decode() for row in out] == ["KAIYATKM", "ΓΒΑ"]


def test_server_reports_models_ready_and_binds_loopback(tiny_server):
    states = {m["name"]: m["state"] for m in tiny_server.model_states()}
    assert states == {"affine": "READY", "reverse": "READY"}
    assert tiny_server.metadata()["version"].startswith("2.")
    assert tiny_server.endpoints.host == "127.0.0.1"
    assert "--http-address=127.0.0.1" in tiny_server.command()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_model_the_server_has_unloaded_is_not_the_requests_fault(tiny_server, protocol):
    """What a job's requests meet while a server shuts down (it unloads its models before closing
    its port) or serve reloads a model: ModelNotServedError, which a ServerPool sends elsewhere,
    never the record's own InferenceError."""
    endpoint = tiny_server.endpoints.http_url if protocol == "http" else tiny_server.endpoints.grpc_url
    with TritonClient(f"{protocol}://{endpoint}") as client:
        client.unload_model("affine")
        try:
            with pytest.raises(ModelNotServedError, match="affine: the server at .* does not serve it now"):
                client.infer("affine", {"x": np.ones((1, 3), np.float32)})
        finally:
            client.load_model("affine")
        np.testing.assert_array_equal(client.infer("affine", {"x": np.ones((1, 3), np.float32)})["y"],
                                      np.full((1, 3), 3.0, np.float32))


def test_stop_leaves_no_process_behind(tmp_path, triton_install):
    repo = tiny_repository(tmp_path / "models")
    server = TritonServer(repo, install=triton_install, log_file=tmp_path / "server.log")
    server.start(timeout=120)
    pid = server.pid
    assert pid is not None
    # The server and at least one Python-backend stub per model run in the server's group.
    assert len(_group_members(pid)) >= 3
    server.stop()
    assert not server.is_running()
    assert _group_members(pid) == []
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_model_that_fails_to_load_gives_a_readable_error(tmp_path, triton_install):
    repo = broken_repository(tmp_path / "models")
    server = TritonServer(repo, install=triton_install, log_file=tmp_path / "server.log")
    with pytest.raises(TritonStartError) as excinfo:
        server.start(timeout=120)
    message = str(excinfo.value)
    assert "exited with code" in message
    # Triton's own explanation, quoted from the log: which model and why.
    assert "broken" in message
    assert "deliberately broken model" in message
    assert not server.is_running()


SLOW_INITIALIZE = """\
import time


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(30)  # still loading when the start gives up
"""


class _ObservedServer(TritonServer):
    """Notes this server's shared-memory regions at the moment stop() is called."""

    def stop(self, grace: float | None = None) -> int | None:
        self.regions_at_stop = self.shared_memory_regions()
        return super().stop(grace)


def test_a_start_that_gives_up_leaves_no_shared_memory_behind(tmp_path, triton_install):
    """Finding: a start cut short (not ready in time, or Ctrl-C while the models load) left the
    Python backend's regions in /dev/shm. Only this server's regions are removed: their prefix is
    unique to it."""
    repo = tiny_repository(tmp_path / "models")
    (repo / "reverse" / "1" / "model.py").write_text(SLOW_INITIALIZE)
    server = _ObservedServer(repo, install=triton_install, log_file=tmp_path / "server.log")
    assert f"--backend-config=python,shm-region-prefix-name={server.shm_prefix}" in server.command()
    with pytest.raises(TritonStartError, match="not ready after") as raised:
        server.start(timeout=10)
    # The error says what is still loading and what its stubs are doing.
    message = str(raised.value)
    assert "Models still loading: reverse\n" in message
    assert re.search(r"stub reverse_\d+_\d+ \(pid \d+\): state [RSD], [\d.]+ s CPU, \d+ threads, waiting in ",
                     message), message
    assert len(server.regions_at_stop) >= 2  # one per instance: affine loaded, reverse initializing
    assert server.shared_memory_regions() == []
    assert not any(region.exists() for region in server.regions_at_stop)


def test_the_server_dies_with_the_process_that_started_it(tmp_path, triton_install):
    """Finding: a killed parent (even with SIGKILL) left its tritonserver running. The server gets
    a parent-death signal (SIGTERM), shuts down in order and takes its stubs with it."""
    repo = tiny_repository(tmp_path / "models")
    script = (
        "import sys, time\n"
        "from bionemo_export.runtime import TritonServer\n"
        f"server = TritonServer({str(repo)!r}, log_file={str(tmp_path / 'server.log')!r}).start(timeout=120)\n"
        "print(server.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None  # stdout=PIPE
        server_pid = int(parent.stdout.readline())
        members = _group_members(server_pid)
        assert len(members) >= 3  # the server and a stub per model
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while _group_members(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _group_members(server_pid)
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in _group_members(server_pid) if "server_pid" in locals() else ():
            os.kill(pid, signal.SIGKILL)  # only when the test fails: the server this test started
    assert left == [], f"still running after their parent was killed: {left}"


def test_a_missing_repository_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model repository not found"):
        TritonServer(tmp_path / "nope")


def test_probe_reads_the_server_version(triton_install):
    meta = probe_server(triton_install)
    assert meta["name"] == "triton"
    assert meta["version"] == "2.51.0"


def test_perf_analyzer_measures_the_served_model(tiny_server, tmp_path):
    """perf_analyzer sweeps concurrency 1 and 2 against the served model and writes a row for each.
    A concurrency whose windows never agree within --stability-percentage is left out of the CSV
    and ends the sweep with exit code 0 (perf_analyzer's inference_profiler.cc): on two cores shared
    with four other test workers, latencies swing more than 2x between windows, and a CI run wrote
    one row. This test is about the served model being measured, not about this host's quiet, so
    any window counts as stable (999 %). The CSV's rows come in throughput order, not concurrency
    order (one run wrote 2 before 1: concurrency 2 answered 648/s, 1 answered 1006/s)."""
    pa = find_perf_analyzer()
    report = tmp_path / "latency.csv"
    result = pa.run(
        [
            "-m", "affine",
            "-u", tiny_server.endpoints.grpc_url,
            "-i", "grpc",
            "--shape", "x:16",
            "--concurrency-range", "1:2",
            "--measurement-mode", "count_windows",
            "--measurement-request-count", "50",
            "--stability-percentage", "999",
            "-f", str(report),
        ],
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Throughput" in result.stdout
    rows = report.read_text().strip().splitlines()
    assert rows[0].startswith("Concurrency,Inferences/Second")
    assert sorted(row.split(",")[0] for row in rows[1:]) == ["1", "2"], result.stdout + result.stderr
    throughput = [float(r.split(",")[1]) for r in rows[1:]]
    assert all(t > 0 for t in throughput)


def test_a_repository_whose_path_has_spaces_is_served(tmp_path, triton_install):
    """Found by a benchmark: the Python backend splits its stubs' command line on spaces, so a model
    folder with a space in its path crashed tritonserver ("stol"). The server is given a link."""
    repo = tiny_repository(tmp_path / "my models" / "repo one")
    with TritonServer(repo, install=triton_install, log_file=tmp_path / "tritonserver.log") as server:
        assert isinstance(server.served_path, Path)  # a local folder: a path (a link to it), not a URL
        assert " " not in str(server.served_path) and server.served_path.resolve() == repo.resolve()
        client = httpclient.InferenceServerClient(server.endpoints.http_url)
        x = np.array([[1.0, 2.0, 3.0]], dtype=np.float32)
        inp = httpclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(output(client.infer("affine", [inp]), "y"), 2 * x + 1)
