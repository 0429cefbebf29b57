"""Linux's /proc, read in one place: a process's stat fields, command line, threads and memory; the
children of a process; the host's free memory and CPU model.

    stat = process_stat(pid)            # None: gone (or not ours to read)
    stat.ppid, stat.zombie, stat.cpu_ticks
    [child.pid for child in children(server_pid) if not child.zombie]
    command_line(pid)                   # ["tritonserver", "--model-repository=...", ...]
    memory_bytes(pid, "RssAnon"), threads(pid), available_memory_bytes()

Processes end between two looks at /proc: every function answers None (or 0, or leaves the process
out) for one that is gone instead of raising. Where /proc does not exist (not Linux), the same: no
processes, no figures (`alive` asks the kernel instead). Imports only the standard library, so every
layer may use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessStat:
    """The fields of /proc/PID/stat that this project reads (proc(5) numbers them in brackets)."""

    pid: int
    command: str
    """(2) comm: the executable's name, cut to 15 characters; a zombie keeps it."""
    state: str
    """(3) R running, S sleeping, D disk sleep, Z zombie (ended, not yet reaped), T stopped, ..."""
    ppid: int
    """(4) the parent's pid."""
    pgrp: int
    """(5) the process group."""
    minflt: int
    """(10) minor page faults of the process itself."""
    cminflt: int
    """(11) minor page faults of its reaped children."""
    majflt: int
    """(12) major page faults of the process itself."""
    cmajflt: int
    """(13) major page faults of its reaped children."""
    utime: int
    """(14) user CPU time, in clock ticks."""
    stime: int
    """(15) system CPU time, in clock ticks."""
    cutime: int
    """(16) user CPU time of its reaped children, in clock ticks."""
    cstime: int
    """(17) system CPU time of its reaped children, in clock ticks."""

    @property
    def zombie(self) -> bool:
        """Ended, waiting for its parent to reap it: it runs no more."""
        return self.state == "Z"

    @property
    def cpu_ticks(self) -> int:
        """User plus system CPU time so far: it advances while the process works."""
        return self.utime + self.stime


def parse_stat(pid: int, text: str) -> ProcessStat:
    """The contents of /proc/PID/stat as a ProcessStat. The command is in parentheses and may hold
    spaces and parentheses itself: the fields after it are found from the last ")". Raises
    ValueError (naming the pid) for text that is not a stat line."""
    try:
        head, tail = text.rsplit(")", 1)
        command = head.split("(", 1)[1]
        fields = tail.split()  # fields[0] is field (3)
        numbers = [int(fields[index - 3]) for index in (4, 5, 10, 11, 12, 13, 14, 15, 16, 17)]
    except (ValueError, IndexError) as err:
        raise ValueError(f"/proc/{pid}/stat is not a stat line ({err}): {text[:80]!r}") from None
    return ProcessStat(pid, command, fields[0], *numbers)


def process_stat(pid: int) -> ProcessStat | None:
    """/proc/PID/stat of `pid`; None when it is gone or cannot be read or parsed."""
    try:
        return parse_stat(pid, (PROC / str(pid) / "stat").read_text())
    except (OSError, ValueError):
        return None


def pids() -> list[int]:
    """The pids /proc lists now, in its order (empty where there is no /proc)."""
    try:
        return [int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit()]
    except OSError:
        return []


def processes() -> list[ProcessStat]:
    """Every process whose stat can be read now, zombies included."""
    found = []
    for pid in pids():
        stat = process_stat(pid)
        if stat is not None:
            found.append(stat)
    return found


def children(pid: int) -> list[ProcessStat]:
    """The processes whose parent is `pid`, zombies included (check `.zombie`)."""
    return [stat for stat in processes() if stat.ppid == pid]


def alive(pid: int) -> bool:
    """Whether `pid` runs on this host: it exists and is not a zombie (one waiting for a reaper
    counts as ended). A process /proc does not show (another user's where /proc is mounted with
    hidepid, or no /proc at all) is asked of the kernel with signal 0, so that it is not taken for
    gone: lock holders (client/job_lock.py, runtime/job_lease.py) are judged by this. A pid that is
    not a process's (0 or less, larger than any) is not alive."""
    if pid <= 0:  # signal 0 to 0 or -N would ask about a process group, not a process
        return False
    stat = process_stat(pid)
    if stat is not None:
        return not stat.zombie
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # it exists, as another user's
        return True
    return True


def command_line(pid: int) -> list[str] | None:
    """The arguments `pid` was started with (undecodable bytes replaced); None when it is gone or
    not ours to read. A zombie's is empty."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    if not raw:
        return []
    arguments = raw.decode(errors="replace").split("\0")
    return arguments[:-1] if raw.endswith(b"\0") else arguments  # each argument ends with a NUL


def status_value(pid: int, key: str) -> str | None:
    """The value of `key` ("Threads", "VmRSS", ...) in /proc/PID/status, as written ("12",
    "1024 kB"); None when the process is gone or has no such line."""
    try:
        text = (PROC / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return value.strip()
    return None


def wait_channel(pid: int) -> str:
    """The kernel function `pid` sleeps in (/proc/PID/wchan: "futex_wait_queue", "do_epoll_wait",
    ...; "0" when it runs), "" when gone or hidden: a process that never gets anywhere shows here
    whether it waits on a lock, on I/O or on nothing."""
    try:
        return (PROC / str(pid) / "wchan").read_text().strip()
    except OSError:
        return ""


def threads(pid: int) -> int:
    """How many threads `pid` runs (0 when it is gone)."""
    value = status_value(pid, "Threads")
    return int(value) if value else 0


def memory_bytes(pid: int, part: str = "VmRSS") -> int:
    """Resident memory of `pid` in bytes (0 when it is gone): all of it (VmRSS), or one part of it:
    RssAnon (its own heap and stacks), RssShmem (shared memory it maps), RssFile (mapped files)."""
    value = status_value(pid, part)
    return int(value.split()[0]) * 1024 if value else 0


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo: what can be allocated without swapping; None where it
    cannot be read."""
    try:
        for line in (PROC / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_model() -> str | None:
    """The first CPU's model name from /proc/cpuinfo; None where it cannot be read."""
    return _cpuinfo_value("model name")


def cpu_flags() -> set[str]:
    """The first CPU's feature flags from /proc/cpuinfo (avx512f, amx_int8, ...); empty where it
    cannot be read."""
    return set((_cpuinfo_value("flags") or "").split())


def _cpuinfo_value(key: str) -> str | None:
    try:
        text = (PROC / "cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    return None
