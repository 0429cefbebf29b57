"""One owner per bulk job output: a second run on the same output refuses at once, naming the holder.

- A local output (a directory, or the `<file>.parts/` folder beside a single-file output) is held
  with an exclusive `flock` on a lock file in its work folder (`LocalOutputLock`), which records
  host, pid and start. The kernel releases a flock when its holder dies, however it dies: a run
  killed with SIGKILL leaves a lock that the next run simply takes (saying so in one line).
- An `s3://` output is also held with a lease object beside it (runtime/job_lease.py), which the
  owner renews and which expires when it stops renewing.

Both are `OutputLease`s: context managers that take the output on enter (raising JobLockedError
when another live run holds it) and give it back on exit.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from bionemo_export.errors import InvalidInputError
from bionemo_export.procfs import alive

Notice = Callable[[str], None]
"""Where a lease says one line the user should read (a dead holder's lock taken over)."""
LOCK_FILE = "job.lock"
"""The lock file of a job's work folder."""


class JobLockedError(InvalidInputError):
    """Another run holds the job's output: the message names the holder (host, pid, since when)
    and how to take over (wait for it, stop it, or remove the lock when it is certainly dead)."""


class OutputLease(Protocol):
    """The right to write one job output, held for the length of a run."""

    def __enter__(self) -> OutputLease:
        """Take the output; raise JobLockedError naming the holder when another live run has it.
        Taking over from a dead (same host) or expired holder is said in one line to `notice`."""
        ...

    def __exit__(self, *exc: object) -> None:
        """Give the output back (remove or expire the lease)."""
        ...


class LocalOutputLock:
    """An exclusive, non-blocking flock on the file `path`, held from enter to exit, the file holding
    the holder's host, pid and start (JSON) for the message a second run prints.

        with LocalOutputLock(work / LOCK_FILE, notice=print):
            ...   # this run alone writes the folder

    The file is removed on exit: a record found on enter is a holder that died without exit (its
    lock went with it), said to `notice`. A run that opened the file just before the holder removed
    it finds, once it has the lock, that the path no longer names what it locked, and opens it again:
    two runs never hold two different files under one name."""

    def __init__(self, path: Path, notice: Notice = lambda line: None) -> None:
        self.path, self.notice = Path(path), notice
        self._fd: int | None = None

    def __enter__(self) -> LocalOutputLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise JobLockedError(self._held(holder)) from None
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the holder removed the file as it finished: lock the one the path names now
        left = _read(fd)
        if left:  # the kernel released a dead holder's lock; its record stayed
            self.notice(f"{self.path}: took over from pid {left.get('pid', '?')} on host {left.get('host', '?')} "
                        f"(since {left.get('started', '?')}), {_gone(left)}")
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is None:
            return
        try:
            if _same_file(self._fd, self.path):
                self.path.unlink()  # before the lock goes: a later run never reads our record as a dead holder's
        finally:
            os.close(self._fd)  # releases the flock
            self._fd = None

    def _held(self, holder: dict[str, Any]) -> str:
        if not holder:  # the holder has the lock and has not written its record yet
            return (f"{self.path.parent}: another run is starting on this job's output (it holds {self.path}); "
                    "wait for it to finish, or stop it")
        pid = holder.get("pid", "?")
        return (f"{self.path.parent}: another run works on this job's output: held by pid {pid} on host "
                f"{holder.get('host', '?')} since {holder.get('started', '?')}; wait for it to finish, or stop it "
                f"(kill {pid}); if it is certainly gone, remove {self.path}")


def _read(fd: int) -> dict[str, Any]:
    """The holder's record in the lock file; {} when it is empty or not one this module writes."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _same_file(fd: int, path: Path) -> bool:
    try:
        found = path.stat()
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)


def _gone(record: dict[str, Any]) -> str:
    """Why a recorded holder no longer holds the lock, as far as this host can tell."""
    pid = record.get("pid")
    if record.get("host") == socket.gethostname() and isinstance(pid, int) and not alive(pid):
        return "which is no longer running"
    return "which no longer holds the lock (it stopped without giving it back)"
