"""Where a build writes, and how its result appears at once or not at all.

    with signals_interrupt_the_build():
        with staged_directory(out, force=False, log=print) as stage:
            with stage.temporary_files() as tmp:      # every temporary file of the build
                ...                                   # export into tmp
            write_the_repository(stage.repository)
        # here `out` is the finished repository; on any error or signal nothing is left

Everything a build writes lives in one folder it owns beside the destination,
`.NAME.building-PID-XXXX/`: `repository/` (the staged repository, renamed into place only when
everything succeeded, so an existing repository is replaced with `force` in one rename), `tmp/`
(every temporary file: ONNX exports, optimized graphs, Model Navigator's workspace, whatever
torch or onnxruntime write to the temp folder) and, during a `force` swap, `replaced/`. The folder
is removed when the build ends, however it ends: failures and SIGTERM, SIGINT or SIGHUP (turned
into `BuildInterrupted` by `signals_interrupt_the_build`, so the cleanup runs). A build killed
outright (SIGKILL, power loss) cannot clean up; the next build into the same place removes its
folder, knowing it stale from the PID in its name (`remove_stale_builds`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from bionemo_export import procfs
from bionemo_export.errors import UserError, reason

Progress = Callable[[str], None]
LOG = logging.getLogger(__name__)


class StagingError(UserError, RuntimeError):
    """The build's folder cannot be made beside the destination, or the destination appeared during
    the build; the message names the folder and what to do."""


class BuildInterrupted(BaseException):
    """A signal (SIGTERM, SIGINT, SIGHUP) stopped the build. A BaseException, like
    KeyboardInterrupt, so that no `except Exception` on the way (exporter fallbacks) swallows it
    and the build's cleanup runs."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"build interrupted by {signal.Signals(signum).name}; its files were removed")


INTERRUPTING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP")
                             if hasattr(signal, name))
"""The signals a build turns into BuildInterrupted (SIGHUP: the terminal closed)."""


@dataclass(frozen=True)
class Stage:
    """The folder a build owns beside its destination, while the build runs."""

    folder: Path
    """`.NAME.building-PID-XXXX/`, removed when the build ends."""

    @property
    def repository(self) -> Path:
        """Where the repository is written; renamed to the destination when the build succeeds."""
        return self.folder / "repository"

    @property
    def retired(self) -> Path:
        """Where an existing destination goes during a `force` swap (removed with the folder)."""
        return self.folder / "replaced"

    def temporary_files(self) -> contextlib.AbstractContextManager[Path]:
        """A context in which every temporary file of the process and of the processes it starts
        is made in this build's `tmp/` folder (see `temporary_files_in`)."""
        return temporary_files_in(self.folder / "tmp")


@contextlib.contextmanager
def staged_directory(out: Path, *, force: bool, log: Progress = lambda message: None) -> Iterator[Stage]:
    """A build's own folder beside `out`, for the block to write the repository in
    (`stage.repository`). When the block ends normally the repository is renamed to `out`
    (replacing an existing `out` only with `force`, in one rename); however the block ends, the
    folder and everything in it are removed. Folders of builds into `out` whose process no longer
    runs are removed first. Raises StagingError when the folder cannot be made, or when `out`
    appeared during the build without `force`."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_builds(out, log)
        folder = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-{os.getpid()}-", dir=out.parent))
    except OSError as err:
        raise StagingError(f"cannot write beside {out}: {reason(err)}") from err
    stage = Stage(folder)
    try:
        stage.repository.mkdir()
        yield stage
        _move_into_place(stage.repository, out, force, retired=stage.retired)
    finally:
        _discard_build_folder(folder, out, log)


@contextlib.contextmanager
def scratch_folder(out: Path, purpose: str) -> Iterator[Path]:
    """A folder beside `out` for files that outlive one staged build but not the command (`purpose`
    ends its name: `precision auto`'s graph cache, shared by its tries), named as a build's folder
    is, so that `remove_stale_builds` removes it when its process was killed; removed when the
    block ends, however it ends."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-{os.getpid()}-", suffix=f"-{purpose}",
                                       dir=out.parent))
    except OSError as err:
        raise StagingError(f"cannot write beside {out}: {reason(err)}") from err
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _move_into_place(staging: Path, out: Path, force: bool, retired: Path) -> None:
    """Rename `staging` to `out`; with `force` an existing `out` is first renamed to `retired`
    (inside the build's folder, so the build's cleanup removes it)."""
    if not out.exists():
        staging.rename(out)
        return
    if not force:
        raise StagingError(f"{out} appeared during the build; pass `force` to replace it")
    # Swap with two renames so `out` is never a half-written folder.
    out.rename(retired)
    staging.rename(out)


# -- what a build owns, and what a killed build left behind ------------------------------------------------------

def _build_folder_owner(out: Path, folder: Path) -> int | None:
    """The PID in the name of a build folder of `out` (`.NAME.building-PID-XXXX`), else None."""
    match = re.fullmatch(rf"\.{re.escape(out.name)}\.building-(\d+)-.+", folder.name)
    return int(match.group(1)) if match else None


def remove_stale_builds(out: Path, log: Progress = lambda message: None) -> list[Path]:
    """Remove the folders that builds into `out` left beside it when they were killed (their
    process no longer runs); returns them. A build killed in the middle of a `force` swap leaves
    the previous repository in its `replaced/` folder: it is put back at `out` first. Builds of
    other hosts sharing the folder are not told apart (PIDs are per host)."""
    if not out.parent.is_dir():
        return []
    removed = []
    for folder in sorted(out.parent.iterdir()):
        pid = _build_folder_owner(out, folder)
        if pid is None or pid == os.getpid() or procfs.alive(pid):
            continue
        _discard_build_folder(folder, out, log)
        _log_warning(log, f"removed {folder}, left by build process {pid}, which no longer runs")
        removed.append(folder)
    return removed


def _discard_build_folder(folder: Path, out: Path, log: Progress) -> None:
    """Remove a build's folder. A build stopped between the two renames of a `force` swap has
    the previous repository in `replaced/` and none at `out`: it is put back first."""
    previous = folder / "replaced"
    if previous.is_dir() and not out.exists():
        previous.rename(out)
        _log_warning(log, f"restored {out} from {folder.name}: its build stopped while replacing it")
    shutil.rmtree(folder, ignore_errors=True)


def _log_warning(log: Progress, message: str) -> None:
    LOG.warning(message)
    log(message)


@contextlib.contextmanager
def temporary_files_in(folder: Path) -> Iterator[Path]:
    """Make `folder` the temp folder of this process (tempfile's default directory) and of the
    processes it starts (TMPDIR: Model Navigator's workers) while the block runs, so that every
    temporary file of the build, ours and the libraries' (torch.onnx, onnxruntime's quantizer,
    Model Navigator), lands in the build's own folder and goes when it goes."""
    folder.mkdir()
    saved_tempdir, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = os.environ["TMPDIR"] = str(folder)
    try:
        yield folder
    finally:
        tempfile.tempdir = saved_tempdir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env


@contextlib.contextmanager
def signals_interrupt_the_build() -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP raise BuildInterrupted while the block runs, so the build's
    cleanup runs (their default actions kill the process without it). Further signals are ignored
    until the block has exited, so that they cannot interrupt the cleanup. Only the main thread
    can set signal handlers; elsewhere the block runs with the process's handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        for number in INTERRUPTING_SIGNALS:
            signal.signal(number, signal.SIG_IGN)
        raise BuildInterrupted(signum)

    previous = {number: signal.signal(number, interrupt) for number in INTERRUPTING_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)


def quiet_finalizers_after_an_interrupt() -> None:
    """Call when a build was interrupted and the process is about to exit: from then on an error
    in an object's finalizer is logged at debug level instead of printed with its traceback.

    A signal stops the build inside whatever library code runs at that moment, and some of it
    leaves objects half-made. Found by CI: numpy's `savez` (Model Navigator saving its samples)
    stopped mid-write leaves a zip writer open, and at exit its `__del__` failed with "seek of
    closed file", printing a traceback after the CLI's one-line message. The files those objects
    wrote went with the build's folder, so there is nothing left for them to finish."""
    def log_at_debug(unraisable: sys.UnraisableHookArgs) -> None:
        LOG.debug("after the interrupted build, ignored in %r: %r", unraisable.object, unraisable.exc_value)

    sys.unraisablehook = log_at_debug
