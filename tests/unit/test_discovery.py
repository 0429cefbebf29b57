"""Finding and preparing tritonserver and perf_analyzer."""

from __future__ import annotations

import os
import stat

import pytest

from bionemo_export.runtime import (
    TritonNotFoundError,
    find_perf_analyzer,
    find_tritonserver,
    prepare_embedded_tritonserver,
)


def test_embedded_server_is_prepared_with_the_python_backend_and_its_stub(tmp_path):
    install = prepare_embedded_tritonserver(cache_root=tmp_path)
    assert install.source == "nvidia-pytriton"
    assert install.binary.is_file() and os.access(install.binary, os.X_OK)
    assert "python" in install.backends
    assert (install.backend_directory / "python" / "triton_python_backend_stub").is_file()
    # The stub must see this interpreter's environment through PATH.
    import sys
    from pathlib import Path

    assert install.env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    # Preparing again reuses the folder.
    again = prepare_embedded_tritonserver(cache_root=tmp_path)
    assert again.binary == install.binary
    assert len(list(tmp_path.iterdir())) == 1


def test_a_prepared_folder_whose_environment_is_gone_is_prepared_again(tmp_path):
    """The cache outlives virtual environments: a folder whose `bin` link leads into a deleted one (a
    CI machine's cache prepared by an earlier clone) is replaced, not handed out as the server."""
    import sys

    from bionemo_export.runtime.discovery import _pytriton_package_dir, embedded_install_folder

    wheel_root = _pytriton_package_dir() / "tritonserver"
    target = embedded_install_folder(tmp_path, wheel_root, f"{sys.version_info.major}.{sys.version_info.minor}")
    (target / "backends" / "python").mkdir(parents=True)
    (target / "backends" / "python" / "triton_python_backend_stub").write_bytes(b"")
    (target / "bin").symlink_to(tmp_path / "deleted-venv" / "bin")
    install = prepare_embedded_tritonserver(cache_root=tmp_path)
    assert install.binary == target / "bin" / "tritonserver"
    assert install.binary.is_file() and os.access(install.binary, os.X_OK)
    assert os.readlink(target / "bin") == str((wheel_root / "bin").resolve())  # not through a link to the venv
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # nothing left aside


def test_each_installed_wheel_has_a_folder_of_its_own(tmp_path):
    from pathlib import Path

    from bionemo_export.runtime.discovery import embedded_install_folder

    here = embedded_install_folder(tmp_path, Path("/venv-a/site-packages/pytriton/tritonserver"), "3.11")
    there = embedded_install_folder(tmp_path, Path("/venv-b/site-packages/pytriton/tritonserver"), "3.11")
    assert here != there and here.parent == there.parent == tmp_path
    assert here.name.startswith("tritonserver-pytriton") and "-py3.11-" in here.name


def test_explicit_path_wins_and_a_bad_one_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITONSERVER", raising=False)
    with pytest.raises(TritonNotFoundError, match="does not exist"):
        find_tritonserver(tmp_path / "no-such-tritonserver")
    fake_root = tmp_path / "triton"
    (fake_root / "bin").mkdir(parents=True)
    (fake_root / "backends" / "onnxruntime").mkdir(parents=True)
    (fake_root / "backends" / "onnxruntime" / "libtriton_onnxruntime.so").write_bytes(b"")
    binary = fake_root / "bin" / "tritonserver"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    (fake_root / "TRITON_VERSION").write_text("2.60.0\n")
    found = find_tritonserver(binary)
    assert found.source == "explicit"
    assert found.version == "2.60.0"
    assert found.backends == ("onnxruntime",)
    assert found.can_load("onnxruntime") and not found.can_load("python")


def test_environment_variable_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONSERVER", str(tmp_path / "missing"))
    with pytest.raises(TritonNotFoundError, match=r"\$TRITONSERVER"):
        find_tritonserver()


def test_default_search_finds_a_server_with_the_python_backend(monkeypatch):
    monkeypatch.delenv("TRITONSERVER", raising=False)
    install = find_tritonserver()
    assert install.can_load("python")


def test_perf_analyzer_is_found_and_runs():
    pa = find_perf_analyzer()
    assert pa.version == "2.51.0"
    assert pa.binary.is_file()
    # The binary found runs with the environment it was found with (its CUDA runtime library):
    # it answers --version, and it parses a command line, refusing one without a model by name.
    version = pa.run(["--version"], timeout=30)
    assert version.returncode == 0, version.stderr
    assert "Perf Analyzer Version 2.51.0" in version.stdout + version.stderr
    usage = pa.run(["--concurrency-range", "1:2"], timeout=30)
    assert usage.returncode != 0
    assert "Failed to parse -m (model name)" in usage.stdout + usage.stderr
