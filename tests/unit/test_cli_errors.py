"""The CLI at its edges, without a server or an export: bad input gets one line and a non-zero
exit (no traceback unless --debug), stale build folders are cleaned up, closed ports are named, and
verify's row checks (interrupted builds and verify against a served repository:
tests/e2e/test_cli_edges.py)."""


from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from bionemo_export.build import BuildError, BuildRequest, build_repository, remove_stale_builds
from bionemo_export.cli.main import app, error_line
from bionemo_export.models import get_family
from bionemo_export.runtime import free_ports
from bionemo_export.serving.numerics import cosine_rows, degenerate_rows
from bionemo_export.verify import compare_outputs

runner = CliRunner()


WIDE = {"COLUMNS": "1000"}  # rich wraps long lines (paths) at the terminal width


def _one_line_error(result, *fragments: str) -> str:
    """Assert a CliRunner result is a handled error (non-zero exit, no exception escaped, so no
    traceback) whose output names every fragment; return the output."""
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.output, result.output
    return result.output


def _dead_pid() -> int:
    """The PID of a process that has ended (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_stale_build_folders_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    out = tmp_path / "repo"
    dead = tmp_path / f".repo.building-{_dead_pid()}-abc123"
    (dead / "tmp" / "onnx").mkdir(parents=True)
    (dead / "tmp" / "onnx" / "model.onnx").write_bytes(b"x" * 1000)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        alive = tmp_path / f".repo.building-{sleeper.pid}-def456"
        alive.mkdir()
        mine = tmp_path / f".repo.building-{os.getpid()}-ghi789"
        mine.mkdir()
        other_output = tmp_path / f".other.building-{_dead_pid()}-jkl012"
        other_output.mkdir()
        messages: list[str] = []
        assert remove_stale_builds(out, messages.append) == [dead]
    finally:
        sleeper.kill()
        sleeper.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, mine.name, other_output.name])
    assert messages == [f"removed {dead}, left by build process {dead.name.split('-')[1]}, which no longer runs"]


def test_a_build_killed_while_replacing_a_repository_gets_the_old_one_back(tmp_path):
    out = tmp_path / "repo"
    stale = tmp_path / f".repo.building-{_dead_pid()}-abc123"
    (stale / "replaced").mkdir(parents=True)
    (stale / "replaced" / "manifest.json").write_text("{}")
    (stale / "repository").mkdir()
    messages: list[str] = []
    remove_stale_builds(out, messages.append)
    assert (out / "manifest.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]
    assert messages[0] == f"restored {out} from {stale.name}: its build stopped while replacing it"


def test_build_out_inside_a_file_is_refused_before_loading(esm2_checkpoint, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    result = runner.invoke(app, ["build", "repo", "--model", "esm2", "--checkpoint", str(esm2_checkpoint),
                                 "--name", "esm2nv", "--out", str(tmp_path / "a-file" / "repo")], env=WIDE)
    _one_line_error(result, f"{tmp_path / 'a-file'} is a file, not a folder")
    assert "loading" not in result.output
    with pytest.raises(BuildError, match="a file is there"):
        build_repository(BuildRequest(family="esm2", checkpoint=esm2_checkpoint, name="x",
                                      out=tmp_path / "a-file", force=True, optimize=False))


@pytest.fixture(scope="module")
def garbage_checkpoint(tmp_path_factory) -> Path:
    """A Hugging Face folder whose weights file is random bytes (these ones make torch.load
    fail with "pop from empty list")."""
    folder = tmp_path_factory.mktemp("garbage") / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "esm"}))
    (folder / "pytorch_model.bin").write_bytes(np.random.default_rng(17).bytes(4096))
    return folder


def test_a_garbage_weights_file_is_named_as_not_a_readable_checkpoint(garbage_checkpoint, tmp_path):
    weights = garbage_checkpoint / "pytorch_model.bin"
    built = runner.invoke(app, ["build", "repo", "--model", "esm2", "--checkpoint", str(garbage_checkpoint),
                                "--name", "esm2nv", "--out", str(tmp_path / "repo")], env=WIDE)
    output = _one_line_error(built, f"cannot read weights {weights}: not a readable checkpoint")
    assert "weights_only" not in output  # torch's paragraph about weights_only is cut to its reason
    assert list(tmp_path.iterdir()) == []
    repository = _manifest_only_repository(tmp_path / "repository")
    verified = runner.invoke(app, ["verify", str(repository), "--checkpoint", str(garbage_checkpoint),
                                   "--url", f"http://127.0.0.1:{free_ports(1)[0]}"], env=WIDE)
    _one_line_error(verified, f"cannot read weights {weights}: not a readable checkpoint")


def test_an_unreadable_nemo_archive_is_one_line(tmp_path):
    archive = tmp_path / "model.nemo"
    archive.write_bytes(np.random.default_rng(0).bytes(3000))
    result = runner.invoke(app, ["build", "repo", "--checkpoint", str(archive), "--name", "x",
                                 "--out", str(tmp_path / "repo")], env=WIDE)
    output = _one_line_error(result, f"{archive} is not a readable .nemo archive")
    assert "method gz" not in output  # tarfile's list of every method it tried


def test_a_malformed_config_is_named_with_the_checkpoint(esm2_checkpoint, tmp_path):
    broken = tmp_path / "checkpoint"
    broken.mkdir()
    for item in esm2_checkpoint.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    result = runner.invoke(app, ["build", "repo", "--model", "esm2", "--checkpoint", str(broken), "--name", "x",
                                 "--out", str(tmp_path / "repo")], env=WIDE)
    _one_line_error(result, f"cannot load {broken} as esm2: ZeroDivisionError")


@pytest.mark.parametrize("arguments, message", [
    (["--model", "bert"], "has model_type 'esm', expected 'bert'"),
    (["--model", "esm2", "--tasks", "embeddings,decodes"], "not decodes"),
    (["--model", "nope"], "known families"),
])
def test_wrong_family_and_tasks_are_one_line(esm2_checkpoint, tmp_path, arguments, message):
    result = runner.invoke(app, ["build", "repo", "--checkpoint", str(esm2_checkpoint), "--name", "x",
                                 "--out", str(tmp_path / "repo"), *arguments], env=WIDE)
    _one_line_error(result, message)


def test_a_missing_checkpoint_is_named(tmp_path):
    result = runner.invoke(app, ["build", "repo", "--model", "esm2", "--checkpoint", str(tmp_path / "missing"),
                                 "--name", "x", "--out", str(tmp_path / "repo")], env=WIDE)
    _one_line_error(result, "does not exist")


def test_client_output_into_a_missing_folder_is_refused_before_sending(tmp_path):
    port = free_ports(1)[0]  # nothing listens: the output is checked first
    target = tmp_path / "missing" / "out.json"
    result = runner.invoke(app, ["client", "encode", "-m", "x_embeddings", "-s", "MKV",
                                 "--triton-url", f"http://127.0.0.1:{port}", "--output", str(target)], env=WIDE)
    output = _one_line_error(result, f"--output {target}: {target.parent} is not an existing folder")
    assert "cannot reach" not in output


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_client_against_a_closed_port_names_the_url(scheme):
    url = f"{scheme}://127.0.0.1:{free_ports(1)[0]}"
    result = runner.invoke(app, ["client", "encode", "-m", "x_embeddings", "-s", "MKV", "--triton-url", url],
                           env=WIDE)
    _one_line_error(result, f"cannot reach a Triton server at {url}")


def _manifest_only_repository(folder: Path, **manifest) -> Path:
    """A repository folder with only a manifest.json (enough for verify against --url)."""
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"family": "esm2", "name": "x", "tasks": ["embeddings"],
                                                      **manifest}))
    return folder


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_verify_against_a_closed_port_names_the_url(esm2_checkpoint, tmp_path, scheme):
    url = f"{scheme}://127.0.0.1:{free_ports(1)[0]}"
    repository = _manifest_only_repository(tmp_path / "repository")
    result = runner.invoke(app, ["verify", str(repository), "--checkpoint", str(esm2_checkpoint), "--url", url],
                           env=WIDE)
    _one_line_error(result, f"cannot reach a Triton server at {url}")


def test_bench_against_a_closed_port_names_the_url(tmp_path):
    url = f"http://127.0.0.1:{free_ports(1)[0]}"
    result = runner.invoke(app, ["bench", "--url", url, "-m", "x_embeddings", "--concurrency", "1",
                                 "--out", str(tmp_path / "report")], env=WIDE)
    _one_line_error(result, f"on {url}")


@pytest.mark.parametrize("manifest, message", [
    ("{", "is not valid JSON"),
    ("[]", "is not a JSON object"),
    ("{}", "has no family, name, tasks"),
])
def test_verify_names_a_broken_manifest(esm2_checkpoint, tmp_path, manifest, message):
    repository = tmp_path / "repository"
    repository.mkdir()
    (repository / "manifest.json").write_text(manifest)
    result = runner.invoke(app, ["verify", str(repository), "--checkpoint", str(esm2_checkpoint)], env=WIDE)
    _one_line_error(result, f"{repository / 'manifest.json'} {message}")


def test_error_lines():
    from bionemo_export.client.triton import ServerUnreachableError

    assert error_line(BuildError("--out x: a file is there")) == "error: --out x: a file is there"
    assert error_line(ServerUnreachableError("cannot reach x")) == "error: cannot reach x"
    with pytest.raises(ValueError) as ours:  # a ValueError raised by the package's code is written for users
        get_family("nope")
    assert error_line(ours.value) == f"error: {ours.value}"
    with pytest.raises(ValueError) as numpy_error:
        np.zeros(3).reshape(2)
    assert error_line(numpy_error.value) == ("error: ValueError: cannot reshape array of size 3 into shape (2,) "
                                             "(run with --debug for the traceback)")
    with pytest.raises(FileNotFoundError) as missing:
        open("/nonexistent/file")
    assert error_line(missing.value) == "error: /nonexistent/file: No such file or directory"
    with pytest.raises(KeyError) as key:
        {}["family"]
    assert error_line(key.value) == "error: KeyError: 'family' (run with --debug for the traceback)"


def test_cosine_rows_zero_and_non_finite_rows():
    a = np.array([[1.0, 2.0], [0.0, 0.0], [0.0, 0.0], [1.0, np.nan], [np.inf, 1.0], [3.0, 4.0]])
    b = np.array([[2.0, 4.0], [0.0, 0.0], [1.0, 0.0], [1.0, 2.0], [1.0, 1.0], [-3.0, -4.0]])
    np.testing.assert_allclose(cosine_rows(a, b), [1.0, 1.0, 0.0, 0.0, 0.0, -1.0])
    np.testing.assert_allclose(cosine_rows(b, a), [1.0, 1.0, 0.0, 0.0, 0.0, -1.0])
    big = np.full((1, 8), 3e38, dtype=np.float32)  # fp32 norms would overflow
    assert cosine_rows(big, big)[0] == pytest.approx(1.0)
    assert cosine_rows(np.ones((2, 3, 4)), np.ones((2, 3, 4))).shape == (2, 3)
    with pytest.raises(ValueError, match="shapes differ"):
        cosine_rows(np.ones((2, 3)), np.ones((3, 3)))


def test_degenerate_rows_are_described():
    reference = np.arange(1.0, 13.0).reshape(4, 3)
    assert degenerate_rows(reference, reference) is None
    served = reference.copy()
    served[0] = 0.0
    served[1] = 7.0
    served[2, 1] = np.nan
    assert degenerate_rows(served, reference) == ("1 of 4 rows hold NaN or Inf; 1 of 4 rows are all zeros; "
                                                  "1 of 4 rows are constant (every entry equal)")
    # A row that is zero in the reference too is legitimate.
    assert degenerate_rows(np.zeros((2, 3)), np.zeros((2, 3))) is None
    assert degenerate_rows(np.zeros((2, 3))) == "2 of 2 rows are all zeros"


def test_an_all_zero_served_output_fails_whatever_the_tolerance():
    reference = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
    zeros = compare_outputs(np.zeros_like(reference), reference)
    assert zeros.min_cosine == 0.0
    assert zeros.problem is not None and "3 of 3 rows are all zeros" in zeros.problem
    assert not zeros.within(atol=float("inf"), min_cosine=-1.0)
    nan = compare_outputs(np.full_like(reference, np.nan), reference)
    assert not nan.within(atol=float("inf"), min_cosine=-1.0) and nan.problem is not None and "NaN" in nan.problem
    same = compare_outputs(reference.copy(), reference)
    assert same.problem is None and same.within(atol=0.0, min_cosine=0.999999)
    narrower = compare_outputs(reference[:, :7], reference).problem
    assert narrower is not None and "served shape [3, 7]" in narrower
