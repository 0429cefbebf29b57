"""A repository's files against the digests its build recorded (issue 16, part 5).

Finding: 2,000 changed bytes inside an encoder's model.onnx: the server became ready, `health` said
ok, every answer was wrong, and nothing recorded what the build had written. Now manifest.json
records a sha256 of every file, and `serve`, `verify` and `repo push` refuse a repository whose
files changed, naming them (exit code 2; `--no-check` skips the comparison). Also here: a corrupt
tokenizer.json is refused naming the file, not with a bare JSONDecodeError.

One tiny random ESM-2 repository is built for the module; each test that changes files changes a
copy of it. The checks that need no build: tests/unit/test_integrity_records.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from bionemo_export.model_repository.integrity import (
    IntegrityError,
    check_files,
    check_repository_files,
    require_intact,
)
from bionemo_export.model_repository.manifest import MANIFEST_NAME, Manifest
from bionemo_export.model_repository.options import ServingOptions
from bionemo_export.serving.tokenizers import CharacterTokenizer
from tests.helpers import serve_process as sp
from tests.unit.test_integrity_records import _without_digests

NAME = "integ"
ENCODER_ONNX = f"{NAME}_encoder/1/model.onnx"
TOKENIZER_JSON = f"{NAME}_encoder/1/tokenizer.json"
FIX = "rebuild the repository or pass --no-check"
NO_SERVER = "/nonexistent/tritonserver"
"""--tritonserver for the runs that must get past the check: the command then fails at once."""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """(repository, checkpoint): a tiny random ESM-2 build, never changed by a test."""
    from bionemo_export.build import BuildRequest, build_repository
    from bionemo_export.testing.checkpoints import save_random_checkpoint

    work = tmp_path_factory.mktemp("integrity")
    checkpoint = save_random_checkpoint("esm2", work / "checkpoint", seed=0)
    build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name=NAME, out=work / "repo",
                                  backend="python", serving=ServingOptions(max_batch_size=4), optimize=False))
    return work / "repo", checkpoint


@pytest.fixture
def repo(built, tmp_path) -> Path:
    """A copy of the built repository that the test may change."""
    return Path(shutil.copytree(built[0], tmp_path / "repo"))


def _files(root: Path) -> list[str]:
    return sorted(path.relative_to(root).as_posix() for path in root.rglob("*") if path.is_file())


def _flip_bytes(path: Path, count: int = 2000) -> None:
    """Invert `count` bytes in the middle of the file: its size stays the same."""
    data = bytearray(path.read_bytes())
    start = len(data) // 2
    assert len(data) > start + count
    data[start:start + count] = bytes(b ^ 0xFF for b in data[start:start + count])
    path.write_bytes(bytes(data))


def _cli(*args: str) -> subprocess.CompletedProcess:
    # Wide: rich would otherwise wrap the long paths of Triton's error lines.
    return subprocess.run([*sp.CLI, *args], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "COLUMNS": "1000"})


def _serve(repository: Path, *args: str) -> subprocess.CompletedProcess:
    return _cli("serve", str(repository), "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", *args)


# -- what the build records -----------------------------------------------------------------------

def test_the_manifest_records_a_digest_of_every_file_the_build_wrote_but_itself(built):
    repository = built[0]
    files = json.loads((repository / MANIFEST_NAME).read_text())["files"]
    written = _files(repository)
    assert MANIFEST_NAME in written and MANIFEST_NAME not in files
    assert sorted(files) == [name for name in written if name != MANIFEST_NAME]
    # The ensembles' README.md placeholders (they keep empty version folders in object storage) too.
    assert {f"{NAME}_embeddings/1/README.md", f"{NAME}_hiddens/1/README.md", ENCODER_ONNX, TOKENIZER_JSON} <= set(files)
    for name, record in files.items():
        content = (repository / name).read_bytes()
        assert record == {"sha256": hashlib.sha256(content).hexdigest(), "bytes": len(content)}, name
    assert check_repository_files(repository) == []
    assert require_intact(repository).startswith(f"files: {len(files)} match {repository / MANIFEST_NAME}")


# -- what the check finds -------------------------------------------------------------------------

def test_two_thousand_changed_bytes_inside_model_onnx_are_reported_naming_it(repo):
    _flip_bytes(repo / ENCODER_ONNX)
    problems = check_repository_files(repo)
    assert len(problems) == 1
    assert problems[0].startswith(f"{repo / ENCODER_ONNX} changed since the build (sha256 ")
    with pytest.raises(IntegrityError) as raised:
        require_intact(repo)
    assert str(raised.value) == f"{problems[0]}; {FIX}"


def test_a_deleted_file_and_a_truncated_one_are_reported(repo):
    (repo / TOKENIZER_JSON).unlink()
    onnx = repo / ENCODER_ONNX
    size = onnx.stat().st_size
    onnx.write_bytes(onnx.read_bytes()[:1000])
    problems = check_repository_files(repo)
    assert sorted(problems) == sorted([
        f"{repo / TOKENIZER_JSON} is missing (the build wrote it: "
        f"{Manifest.read(repo).files[TOKENIZER_JSON]['bytes']} bytes)",
        f"{repo / ENCODER_ONNX} changed since the build (1000 bytes, recorded {size})",
    ])
    with pytest.raises(IntegrityError, match=f"2 files differ from what the build recorded:\n  .*\n  .*\n{FIX}$"):
        require_intact(repo)


def test_a_file_added_to_a_built_model_folder_is_reported_but_not_what_serving_writes(repo):
    """A second version folder is what Triton would serve instead of 1/; __pycache__ is what the
    Python backend writes when it imports model.py, hidden files are the system's or an editor's."""
    added = repo / f"{NAME}_encoder/2/model.py"
    added.parent.mkdir()
    added.write_text("# not built\n")
    pycache = repo / f"{NAME}_encoder/1/__pycache__/model.cpython-311.pyc"
    pycache.parent.mkdir()
    pycache.write_bytes(b"\0" * 16)
    (repo / f"{NAME}_encoder/1/.DS_Store").write_bytes(b"\0")
    assert check_repository_files(repo) == [
        f"{added} was not written by the build (Triton loads what is in a model's folder)"]


def test_files_beside_the_built_models_are_not_refused_and_an_added_model_is_named_unchecked(repo):
    (repo / "engines.timing_cache").write_bytes(b"tactics")
    (repo / "NOTES.md").write_text("ours\n")
    (repo / "mine" / "1").mkdir(parents=True)
    (repo / "mine" / "config.pbtxt").write_text('name: "mine"\n')
    found = check_files(repo)
    assert found.problems == []
    assert found.unchecked_models == ["mine"]
    assert found.summary.endswith("; not built with it, not checked: mine")


def test_a_repository_without_digests_or_without_a_manifest_gets_a_note(repo, tmp_path):
    _without_digests(repo)
    _flip_bytes(repo / ENCODER_ONNX)  # cannot be told: nothing was recorded
    assert check_repository_files(repo) == []
    assert require_intact(repo) == (f"note: {repo / MANIFEST_NAME} records no file digests (built before "
                                    "bionemo-export recorded them, or by hand): its files are not checked; "
                                    "rebuild it to have them checked")
    hand_made = tmp_path / "hand_made"
    (hand_made / "m" / "1").mkdir(parents=True)
    assert require_intact(hand_made).startswith(f"note: {hand_made} has no manifest.json (not built by bionemo-export)")


def test_a_broken_manifest_is_refused_naming_it(repo):
    (repo / MANIFEST_NAME).write_text('{"files": ')
    with pytest.raises(IntegrityError, match=f"^{repo / MANIFEST_NAME} is not valid JSON .*; {FIX}$"):
        require_intact(repo)


def test_a_recorded_path_outside_the_repository_is_refused(repo):
    manifest = Manifest.read(repo)
    replace(manifest, files={**manifest.files, "../outside": {"sha256": "00" * 32, "bytes": 1}}).write(repo)
    assert check_repository_files(repo) == [
        f"{repo / MANIFEST_NAME} records '../outside', which is not a path inside the repository"]


# -- serve, verify and repo push ------------------------------------------------------------------

def test_serve_refuses_a_changed_repository_naming_the_file_before_any_server_starts(repo):
    _flip_bytes(repo / ENCODER_ONNX)
    result = _serve(repo, "--tritonserver", NO_SERVER)  # were the check missing, it would fail fast too
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"error: {repo / ENCODER_ONNX} changed since the build" in result.stderr
    assert FIX in result.stderr
    assert NO_SERVER not in result.stdout + result.stderr  # refused before looking for a server


def test_serve_no_check_gets_past_the_check(repo):
    _flip_bytes(repo / ENCODER_ONNX)
    result = _serve(repo, "--no-check", "--tritonserver", NO_SERVER)
    output = result.stdout + result.stderr
    assert "changed since the build" not in output
    assert f"note: --no-check: the files of {repo} are not compared with its manifest.json" in result.stdout
    assert NO_SERVER in output  # the next step: finding the server, which the bogus path fails at once
    assert result.returncode == 2


def test_serve_checks_an_intact_repository_and_notes_one_without_digests(repo):
    result = _serve(repo, "--tritonserver", NO_SERVER)
    assert f"files: {len(Manifest.read(repo).files)} match {repo / MANIFEST_NAME}" in result.stdout
    assert NO_SERVER in result.stdout + result.stderr
    _without_digests(repo)
    result = _serve(repo, "--tritonserver", NO_SERVER)
    assert f"note: {repo / MANIFEST_NAME} records no file digests" in result.stdout
    assert NO_SERVER in result.stdout + result.stderr


def test_verify_refuses_a_changed_repository_before_loading_the_checkpoint(repo, built):
    (repo / TOKENIZER_JSON).unlink()
    result = _cli("verify", str(repo), "--checkpoint", str(built[1]))
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"error: {repo / TOKENIZER_JSON} is missing" in result.stderr and FIX in result.stderr


def test_verify_repository_refuses_a_changed_repository_from_python_too(repo, built):
    from bionemo_export.verify import verify_repository

    _flip_bytes(repo / ENCODER_ONNX)
    with pytest.raises(IntegrityError, match=f"{repo / ENCODER_ONNX} changed since the build"):
        verify_repository(repo, built[1])


def test_repo_push_refuses_a_changed_repository_before_uploading(repo):
    _flip_bytes(repo / ENCODER_ONNX)
    # No object store runs: the refusal must come before any connection.
    result = _cli("repo", "push", str(repo), "s3://127.0.0.1:9/bucket/path")
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"error: {repo / ENCODER_ONNX} changed since the build" in result.stderr


# -- TensorRT engines (runtime/engines.py; TensorRT itself is not needed for the record) ---------------


# -- every file error names the file --------------------------------------------------------------


@pytest.mark.parametrize("content, problem", [
    (b"\xff\xfe garbage", "'utf-8' codec can't decode byte 0xff"),
    (b'{"vocab": ["<pad>", ', "Expecting value"),
    (b"[1, 2]", "a JSON list, not an object"),
    (b'{"residues": "AC"}', "no 'vocab' setting"),
])
def test_a_corrupt_tokenizer_json_is_refused_naming_the_file(built, tmp_path, content, problem):
    path = tmp_path / "tokenizer.json"
    shutil.copy(built[0] / TOKENIZER_JSON, path)
    assert CharacterTokenizer.from_json(path).vocab_size > 20  # the build's file reads
    path.write_bytes(content)
    with pytest.raises(ValueError) as raised:
        CharacterTokenizer.from_json(path)
    message = str(raised.value)
    assert message.startswith(f"{path} is not a valid tokenizer file (") and problem in message
    assert message.endswith("rebuild the model repository it belongs to, or restore the file the build wrote")


# -- a served repository stays intact ---------------------------------------------------------------

def test_a_repository_still_matches_its_digests_after_it_was_served(repo, triton_install, tmp_path):
    """Serving writes into the version folders (the Python backend compiles model.py and its
    modules into __pycache__/): that must not make the next `serve` refuse the repository."""
    from bionemo_export.runtime import TritonServer

    with TritonServer(repo, install=triton_install, log_file=tmp_path / "server.log") as server:
        assert {model["name"] for model in server.model_states() if model.get("state") == "READY"} >= {
            f"{NAME}_encoder", f"{NAME}_embeddings"}
    assert list((repo / f"{NAME}_encoder/1/__pycache__").glob("*.pyc"))
    assert check_repository_files(repo) == []


@pytest.mark.parametrize("corrupt, named", [
    (lambda repo: (repo / TOKENIZER_JSON).write_bytes(b'{"vocab": ["<cls>", '),
     f"{TOKENIZER_JSON} is not a valid tokenizer file (Expecting value"),
    (lambda repo: (repo / f"{NAME}_encoder/config.pbtxt").write_text(
        (repo / f"{NAME}_encoder/config.pbtxt").read_text().replace('string_value: "16"', 'string_value: "16x"')),
     f"{NAME}_encoder/config.pbtxt: parameter length_bucket is '16x', not an integer"),
])
def test_a_served_model_whose_file_is_broken_fails_to_load_naming_the_file(repo, tmp_path, corrupt, named):
    """With --no-check the server starts on the changed repository; the model that reads the broken
    file fails to load, and serve shows Triton's error line, which names the file."""
    corrupt(repo)
    assert _serve(repo).returncode == 2  # refused first
    result = _serve(repo, "--no-check", "--timeout", "120", "--log-file", str(tmp_path / "server.log"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{repo}/{named}" in result.stdout + result.stderr, result.stdout + result.stderr
