"""One owner per job output (client/job_lock.py): a second process refuses at once naming the holder,
and the lock of a process killed with SIGKILL is taken over, said in one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from bionemo_export.client.job_lock import LOCK_FILE, JobLockedError, LocalOutputLock

HOLD = """
import sys, time
from pathlib import Path
from bionemo_export.client.job_lock import LocalOutputLock
with LocalOutputLock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""


def _holder(path) -> subprocess.Popen:
    """A child process that takes the lock at `path` and holds it until killed."""
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "held"
    return child


def test_a_second_process_is_refused_naming_the_holder_and_a_killed_holder_is_taken_over(tmp_path):
    lock = tmp_path / "out" / LOCK_FILE
    child = _holder(lock)
    try:
        record = json.loads(lock.read_text())
        assert record["pid"] == child.pid and record["host"] == socket.gethostname() and record["started"]
        started = time.monotonic()
        with pytest.raises(JobLockedError) as refused, LocalOutputLock(lock):
            pass
        assert time.monotonic() - started < 1.0  # at once, not after a wait
        message = str(refused.value)
        assert f"held by pid {child.pid} on host {socket.gethostname()} since {record['started']}" in message
        assert f"kill {child.pid}" in message and f"remove {lock}" in message and "\n" not in message
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    said: list[str] = []
    with LocalOutputLock(lock, notice=said.append):  # the kernel let go of the dead holder's lock
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert len(said) == 1 and f"took over from pid {child.pid}" in said[0] and "no longer running" in said[0]
    assert not lock.exists()  # given back: the next run has nothing to say
    quiet: list[str] = []
    with LocalOutputLock(lock, notice=quiet.append):
        pass
    assert quiet == []
