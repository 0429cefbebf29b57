"""`bionemo-export doctor`: each component names the jobs that need it (build, serve, bench), and the
host is judged per job, so a host that only serves (NVIDIA's Triton container with the base
install) passes `doctor --job serve`. The same without torch, in a real subprocess: test_layers.py."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from bionemo_export.cli.main import app
from bionemo_export.doctor import Job, run_checks

runner = CliRunner()
WIDE = {"COLUMNS": "250"}


def test_each_component_names_the_jobs_that_need_it():
    needed = {check.name: set(check.needed_for) for check in run_checks(probe=False)}
    # Serving: the server, and the client health/client/bench speak to it with. A serving component
    # marked build-only would let `doctor --job serve` pass a host that cannot serve.
    assert needed["tritonserver"] == {Job.SERVE}
    assert needed["tritonclient"] == {Job.SERVE, Job.BENCH}
    assert needed["perf_analyzer"] == {Job.BENCH}
    for exporter in ("torch", "transformers", "onnx", "onnxruntime", "Model Navigator"):
        assert needed[exporter] == {Job.BUILD}, exporter
    for optional in ("CPU", "TensorRT", "GPU", "object storage"):
        assert needed[optional] == set(), optional
    assert set(needed) == {"CPU", "tritonserver", "tritonclient", "perf_analyzer", "torch", "transformers", "onnx",
                           "onnxruntime", "Model Navigator", "TensorRT", "GPU", "object storage"}


def test_a_host_without_tritonserver_cannot_serve_but_can_build(tmp_path):
    absent = ["doctor", "--no-probe", "--tritonserver", str(tmp_path / "tritonserver")]
    serve = runner.invoke(app, [*absent, "--job", "serve"], env=WIDE)
    assert serve.exit_code == 1, serve.output
    assert "serve: missing tritonserver" in serve.output
    assert "Missing required components: tritonserver" in serve.output
    rows = {line.split("│")[1].strip(): line for line in serve.output.splitlines() if line.count("│") == 6}
    assert "missing" in rows["tritonserver"] and "serve" in rows["tritonserver"], serve.output
    assert "build" in rows["torch"] and "optional" in rows["GPU"], serve.output

    build = runner.invoke(app, [*absent, "--job", "build"], env=WIDE)
    assert build.exit_code == 0, build.output
    assert "build: ready" in build.output and "serve:" not in build.output
    rows = {line.split("│")[1].strip(): line for line in build.output.splitlines() if line.count("│") == 6}
    assert "not available" in rows["tritonserver"], build.output  # not needed for building: no failure

    every = runner.invoke(app, absent, env=WIDE)  # by default every job is judged
    assert every.exit_code == 1, every.output
    lines = every.output.splitlines()
    assert {"build: ready", "serve: missing tritonserver", "bench: ready"} <= set(lines), every.output


def test_the_full_install_is_ready_for_every_job():
    result = runner.invoke(app, ["doctor", "--no-probe"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert {"build: ready", "serve: ready", "bench: ready"} <= set(result.output.splitlines())
    assert "needed for" in result.output


def test_a_job_none_of_the_choices_is_refused():
    result = runner.invoke(app, ["doctor", "--job", "deploy"], env=WIDE)
    assert result.exit_code == 1
    assert result.output == "error: --job deploy: choose one of build, serve, bench\n"


BLOCKED_CLIENT = """
import json, sys
sys.modules["tritonclient.grpc"] = None  # unimportable, as on a host without tritonclient
from bionemo_export.doctor import Job, missing_for, run_checks
checks = run_checks(probe=False)
print(json.dumps({job.value: missing_for(checks, job) for job in Job}))
"""


def test_without_tritonclient_serving_and_benchmarking_lack_it():
    # In a process of its own: Model Navigator's import (which needs tritonclient) is tried once per process.
    result = subprocess.run([sys.executable, "-c", BLOCKED_CLIENT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    missing = json.loads(result.stdout.splitlines()[-1])
    assert missing["serve"] == ["tritonclient"] and missing["bench"] == ["tritonclient"], missing
    assert "tritonclient" not in missing["build"], missing  # building lacks Model Navigator, which imports it



def test_doctor_shows_the_cpu_features_that_decide_int8_kernels(monkeypatch):
    from bionemo_export.doctor import check_cpu
    from bionemo_export.serving import host

    check = check_cpu()
    assert check.ok and check.found == host.describe_cpu() and "int8 dot products:" in check.found
    monkeypatch.setattr(host, "cpu_description", lambda: {"model": "Zen 3", "features": ["avx2", "fma"],
                                                          "vnni": False})
    avx2 = check_cpu()
    assert avx2.found == "Zen 3 [avx2 fma; int8 dot products: no VNNI (saturating)]"
    assert "no-VNNI graph" in avx2.fix and "golden check" in avx2.fix
