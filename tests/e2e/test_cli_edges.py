"""The CLI at its edges: interrupted builds leave nothing behind, bad input gets one line and a
non-zero exit (no traceback unless --debug), and verify fails on degenerate served outputs.

Builds run for real (a tiny random ESM-2) in a subprocess of the CLI, so that they can be killed;
the served check uses the real embedded tritonserver. Bad input refused before any build or server:
tests/unit/test_cli_errors.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import onnx
import pytest

from bionemo_export.cli.main import app
from tests.helpers.cli import CLI
from tests.unit.test_cli_errors import WIDE, _manifest_only_repository, runner

# -- interrupted builds --------------------------------------------------------------------------------------------

def _start_build(checkpoint: Path, out: Path, system_tmp: Path) -> subprocess.Popen[str]:
    """`build repo` of the tiny ESM-2 in a subprocess whose temp folder (TMPDIR) is `system_tmp`,
    so that any temporary file outside the build's own folder shows up there."""
    system_tmp.mkdir(exist_ok=True)
    return subprocess.Popen(
        [*CLI, "build", "repo", "--model", "esm2", "--checkpoint", str(checkpoint), "--name", "esm2nv",
         "--out", str(out), "--max-batch-size", "4", "--no-optimize"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **WIDE, "TMPDIR": str(system_tmp)},
    )


def _escaped(system_tmp: Path) -> list[Path]:
    """Build files in the system temp folder: ONNX files, or anything named after the project.
    (Libraries leave their own files there at import, before any build: onnxruntime's `.ses`,
    torch's compile cache.)"""
    return [p for p in system_tmp.rglob("*") if p.suffix == ".onnx" or "bionemo" in p.name]


def _wait_for_export(process: subprocess.Popen[str], root: Path, timeout: float = 300) -> list[Path]:
    """Wait until the build has a staging folder beside its output and has written an ONNX file
    (it is exporting); return the ONNX files found under `root`."""
    assert process.stdout is not None, "the build was started without stdout=PIPE"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        staging = list(root.glob(".repo.building-*"))
        exported = [p for p in root.rglob("*.onnx") if p.is_file()]
        if staging and exported:
            return exported
        if process.poll() is not None:
            raise AssertionError(f"the build ended before exporting anything:\n{process.stdout.read()}")
        time.sleep(0.05)
    process.kill()
    raise AssertionError("the build wrote no ONNX file in time")


def test_a_build_killed_with_sigkill_leaves_one_folder_that_the_next_build_removes(esm2_checkpoint, tmp_path,
                                                                                   monkeypatch):
    out, system_tmp = tmp_path / "repo", tmp_path / "system-tmp"
    process = _start_build(esm2_checkpoint, out, system_tmp)
    exported = _wait_for_export(process, tmp_path)
    process.kill()
    process.wait(timeout=60)
    assert process.stdout is not None  # _start_build pipes it
    process.stdout.close()

    # The debris of a killed build: one folder beside the output, named with the build's PID,
    # holding every temporary file of the build (the ONNX export included); nothing in TMPDIR.
    [debris] = tmp_path.glob(".repo.building-*")
    assert debris.name.startswith(f".repo.building-{process.pid}-")
    assert all(path.is_relative_to(debris) for path in exported), exported
    assert _escaped(system_tmp) == []

    # The next build runs in this process (the killed one was the subprocess), its temp folder system_tmp too.
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    again = runner.invoke(app, ["build", "repo", "--model", "esm2", "--checkpoint", str(esm2_checkpoint),
                                "--name", "esm2nv", "--out", str(out), "--max-batch-size", "4", "--no-optimize"],
                          env=WIDE)
    assert again.exit_code == 0, again.output
    assert f"removed {debris}, left by build process {process.pid}, which no longer runs" in " ".join(
        again.output.split())  # rich wraps the long temporary path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo", "system-tmp"]
    assert _escaped(system_tmp) == []
    assert (out / "manifest.json").is_file()


# SIGHUP takes SIGTERM's path through the build (tests/unit/test_build_staging.py interrupts a build
# with each of the three); SIGINT is also Click's KeyboardInterrupt, so both are run here for real.
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_build_stopped_by_a_signal_removes_everything_it_wrote(esm2_checkpoint, tmp_path, signum):
    out, system_tmp = tmp_path / "repo", tmp_path / "system-tmp"
    process = _start_build(esm2_checkpoint, out, system_tmp)
    _wait_for_export(process, tmp_path)
    process.send_signal(signum)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, output
    assert f"build interrupted by {signum.name}; its files were removed" in output
    assert "Traceback" not in output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["system-tmp"]
    assert _escaped(system_tmp) == []


# -- bad input: one line, non-zero exit ----------------------------------------------------------------------------


def test_an_unexpected_error_is_one_line_with_its_type_and_debug_shows_the_traceback(tmp_path):
    # A hand-edited manifest whose models are not a list: nothing checks that, so the TypeError is
    # unexpected and reaches the CLI's handler. `deploy k8s` reads it without torch (a command that
    # loads a checkpoint first costs ~20 s of imports per run here).
    repository = _manifest_only_repository(tmp_path / "repository", models=5)
    (repository / "x_embeddings").mkdir()
    (repository / "x_embeddings" / "config.pbtxt").write_text('name: "x_embeddings"\nbackend: "python"\n')
    arguments = ["deploy", "k8s", str(repository), "--image", "example.org/triton:1", "--out", str(tmp_path / "k8s")]
    plain = subprocess.run([*CLI, *arguments], capture_output=True, text=True, timeout=120, env={**os.environ, **WIDE})
    assert plain.returncode == 1
    assert "Traceback" not in plain.stdout + plain.stderr
    [line] = plain.stderr.strip().splitlines()
    assert line.startswith("error: TypeError: ") and "not int" in line, line  # Python's own words follow the type
    assert line.endswith(" (run with --debug for the traceback)"), line
    debug = subprocess.run([*CLI, "--debug", *arguments], capture_output=True, text=True, timeout=120,
                           env={**os.environ, **WIDE})
    assert debug.returncode == 1
    assert "Traceback (most recent call last)" in debug.stderr and "TypeError" in debug.stderr
    assert not (tmp_path / "k8s").exists()  # nothing written


# -- cosine and degenerate outputs ---------------------------------------------------------------------------------


def _zero_float_outputs(path: Path) -> None:
    """Rewrite the ONNX graph at `path` so that every float output is multiplied by zero."""
    model = onnx.load(path)
    graph = model.graph
    for output in graph.output:
        if output.type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
            continue
        before = f"{output.name}_before_zeroing"
        for node in graph.node:
            node.output[:] = [before if name == output.name else name for name in node.output]
        zero = onnx.helper.make_tensor(f"{output.name}_zero", onnx.TensorProto.FLOAT, [], [0.0])
        graph.initializer.append(zero)
        graph.node.append(onnx.helper.make_node("Mul", [before, zero.name], [output.name]))
    onnx.save(model, path)


def test_verify_fails_on_a_served_repository_whose_outputs_are_all_zeros(esm2_checkpoint, esm2_repository, tmp_path):
    repository = shutil.copytree(esm2_repository, tmp_path / "repo")
    graphs = list(repository.rglob("*.onnx"))
    assert graphs
    for graph in graphs:
        _zero_float_outputs(graph)
    # Held to an int8 repository's tolerance (min cosine only: no absolute error bound), where a
    # zero row used to score cosine 1.0 and pass.
    manifest = json.loads((repository / "manifest.json").read_text())
    (repository / "manifest.json").write_text(json.dumps({**manifest, "precision": "int8"}))
    # The graphs were edited after the build on purpose: --no-check skips the digests' refusal, and
    # the golden check at load is told to warn, not refuse (tests/e2e/test_golden.py sees it refuse):
    # what is tested here is verify's own check of served answers.
    result = runner.invoke(app, ["verify", str(repository), "--checkpoint", str(esm2_checkpoint), "--no-check"],
                           env={**WIDE, "BIONEMO_EXPORT_GOLDEN_CHECK": "warn"})
    assert result.exit_code == 1, result.output
    assert "esm2nv_embeddings" in result.output and "rows are all zeros" in result.output
    assert "served outputs differ from PyTorch" in result.output
