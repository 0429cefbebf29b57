"""build_staging.py without a model: a staged folder is published whole or not at all, and whatever
ends the block (an error, a signal, the destination appearing meanwhile) leaves nothing behind.
The builds that use it are tested in test_build.py and test_cli_edges.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bionemo_export.build_staging import (
    BuildInterrupted,
    StagingError,
    signals_interrupt_the_build,
    staged_directory,
)


def _beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir())


def test_a_finished_block_is_published_and_its_folder_removed(tmp_path):
    out = tmp_path / "repo"
    with staged_directory(out, force=False) as stage:
        assert stage.folder.parent == tmp_path and stage.folder.name.startswith(f".repo.building-{os.getpid()}-")
        (stage.repository / "model.txt").write_text("new")
        assert not out.exists()  # nothing at the destination until the block ends
    assert (out / "model.txt").read_text() == "new"
    assert _beside(out) == ["repo"]


def test_temporary_files_go_to_the_build_folder_while_the_block_runs(tmp_path):
    out = tmp_path / "repo"
    before = tempfile.gettempdir(), os.environ.get("TMPDIR")
    with staged_directory(out, force=False) as stage:
        with stage.temporary_files() as temporary:
            assert temporary == stage.folder / "tmp"
            assert tempfile.gettempdir() == os.environ["TMPDIR"] == str(temporary)
            with tempfile.NamedTemporaryFile() as handle:
                assert Path(handle.name).parent == temporary
        assert (tempfile.gettempdir(), os.environ.get("TMPDIR")) == before
    assert _beside(out) == ["repo"]


def test_an_error_in_the_block_leaves_nothing_and_the_previous_repository_as_it_was(tmp_path):
    out = tmp_path / "repo"
    out.mkdir()
    (out / "model.txt").write_text("old")
    with pytest.raises(RuntimeError, match="export failed"):
        with staged_directory(out, force=True) as stage:
            (stage.repository / "model.txt").write_text("new")
            raise RuntimeError("export failed")
    assert (out / "model.txt").read_text() == "old"
    assert _beside(out) == ["repo"]


def test_force_replaces_the_previous_repository_whole(tmp_path):
    out = tmp_path / "repo"
    out.mkdir()
    (out / "old_only.txt").write_text("old")
    with staged_directory(out, force=True) as stage:
        (stage.repository / "model.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["model.txt"]
    assert _beside(out) == ["repo"]


def test_a_destination_that_appeared_meanwhile_is_kept_without_force(tmp_path):
    out = tmp_path / "repo"
    with pytest.raises(StagingError, match="appeared during the build; pass `force`"):
        with staged_directory(out, force=False) as stage:
            (stage.repository / "model.txt").write_text("new")
            out.mkdir()  # another process wrote it while this one built
            (out / "theirs.txt").write_text("theirs")
    assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"]
    assert _beside(out) == ["repo"]


def test_a_folder_that_cannot_be_made_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(StagingError, match=f"cannot write beside {blocker / 'repo'}"):
        with staged_directory(blocker / "repo", force=False):
            pytest.fail("the block must not run")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_interrupts_the_block_and_its_folder_is_removed(tmp_path, signum):
    """Each signal a build stops on (the CLI's exit code and message for SIGTERM and SIGINT, which
    Click handles apart: tests/e2e/test_cli_edges.py)."""
    out = tmp_path / "repo"
    previous = signal.getsignal(signum)
    with pytest.raises(BuildInterrupted, match=f"interrupted by {signum.name}") as raised:
        with signals_interrupt_the_build(), staged_directory(out, force=False) as stage:
            (stage.repository / "model.txt").write_text("new")
            os.kill(os.getpid(), signum)
            pytest.fail(f"{signum.name} must interrupt the block")
    assert raised.value.signum == signum
    assert _beside(out) == []
    assert signal.getsignal(signum) == previous  # the process's own handler is back


# A zip writer left open by a write that a signal stopped, its file closed before it: at exit its
# finalizer fails ("seek of closed file"), as numpy.savez's did when CI stopped a build mid-write.
_HALF_WRITTEN_ZIP = """
import sys, zipfile
{quiet}
archive = zipfile.ZipFile(sys.argv[1], "w")
archive.writestr("sample.npy", b"x")
archive.fp.close()
"""


@pytest.mark.parametrize("quiet", [False, True], ids=["as-is", "quieted"])
def test_a_finalizer_failing_after_an_interrupt_prints_no_traceback(tmp_path, quiet):
    """The CLI quiets finalizers once a build was interrupted; without that, the same exit prints one."""
    call = "from bionemo_export.build_staging import quiet_finalizers_after_an_interrupt as q; q()"
    script = _HALF_WRITTEN_ZIP.format(quiet=call if quiet else "")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "samples.npz")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    if quiet:
        assert done.stderr == ""
    else:
        assert "Traceback" in done.stderr and "seek of closed file" in done.stderr, done.stderr
