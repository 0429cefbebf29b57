"""What a tritonserver's Python-backend stub processes are doing, read from /proc (Linux).

Each instance of a Python-backend model runs in its own stub process, a child of tritonserver
started as

    triton_python_backend_stub <model folder>/<version>/model.py <shm region> <shm size> <growth>
                               <parent pid> <backend dir> <ipc handle> <instance name> ...

so the process table says, without asking the server (whose queues may be full), which instances
are alive, which died (a zombie: Triton 2.51 reaps a dead stub only when the model that owned it is
unloaded cleanly), how much CPU each has used (work in progress advances it) and how large its
shared-memory region has grown (the Python backend grows a region to fit the largest request and
never shrinks it).

`runtime/supervisor.py` reads it to tell a dead instance from a busy one; `TritonServer` and the
tests read it to find the stubs to end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
SHARED_MEMORY_DIR = Path("/dev/shm")
"""Where the Python backend creates its shared-memory regions (shm_open names)."""
STUB_BINARY = b"triton_python_backend_stub"
_MODEL_FILE, _REGION, _INSTANCE = 1, 2, 8
"""Positions in a stub's command line (python_backend's stub_launcher.cc, r24.10)."""


@dataclass(frozen=True)
class Stub:
    """One stub process of a Python-backend model instance."""

    pid: int
    model: str
    """The model folder's name (the model's name in the repository)."""
    instance: str
    """Triton's instance name, <model>_<group>_<index>; empty where the command line lacks it."""
    region: str
    """The name of its shared-memory region in /dev/shm; empty where the command line lacks it."""
    zombie: bool
    """Dead, waiting for tritonserver to reap it."""
    cpu_ticks: int
    """User plus system CPU time so far, in clock ticks: it advances while the stub works."""

    def region_bytes(self) -> int:
        """The size its shared-memory region has grown to (0 when gone)."""
        try:
            return (SHARED_MEMORY_DIR / self.region).stat().st_size if self.region else 0
        except OSError:
            return 0


def _stat_fields(pid_folder: Path) -> list[str]:
    """/proc/PID/stat after the parenthesised command: state, ppid, ... (fields 3 onwards)."""
    return (pid_folder / "stat").read_text().rsplit(")", 1)[1].split()


def reaped_children(server_pid: int) -> int:
    """What the kernel has added to `server_pid` from children it reaped (/proc/PID/stat's cminflt,
    cmajflt, cutime, cstime): it grows whenever a child process that ran at all ends and is waited
    for. A stub killed and reaped between two looks at /proc is seen only this way. 0 when the
    server is gone."""
    try:
        fields = _stat_fields(PROC / str(server_pid))
    except OSError:
        return 0
    return sum(int(fields[index]) for index in (7, 9, 13, 14))  # stat fields 10, 12, 16, 17


def server_stubs(server_pid: int, model: str | None = None) -> list[Stub]:
    """The stub processes of a tritonserver (of `model` only, if given), zombies included."""
    stubs = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields(entry)
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if int(fields[1]) != server_pid:
            continue
        zombie = fields[0] == "Z"
        if zombie:  # a zombie's command line is empty: the stub is known by its name in stat
            stub_name = (entry / "stat").read_text().split("(", 1)[1].rsplit(")", 1)[0]
            if not STUB_BINARY.decode().startswith(stub_name):
                continue
            stubs.append(Stub(int(entry.name), "", "", "", True, 0))
            continue
        if len(argv) <= _MODEL_FILE or not argv[0].endswith(STUB_BINARY):
            continue
        folder = Path(argv[_MODEL_FILE].decode(errors="replace")).parent.parent.name
        if model is not None and folder != model:
            continue
        text = [arg.decode(errors="replace") for arg in argv]
        stubs.append(Stub(
            pid=int(entry.name), model=folder,
            instance=text[_INSTANCE] if len(text) > _INSTANCE else "",
            region=text[_REGION] if len(text) > _REGION else "",
            zombie=False,
            cpu_ticks=int(fields[11]) + int(fields[12]),  # utime, stime (stat fields 14 and 15)
        ))
    if model is not None:  # a zombie's model cannot be told
        stubs = [stub for stub in stubs if not stub.zombie]
    return stubs


def live_stubs(server_pid: int, model: str | None = None) -> list[Stub]:
    """The running (not zombie) stubs of a tritonserver, of `model` only if given."""
    return [stub for stub in server_stubs(server_pid, model) if not stub.zombie]


def process_threads(pid: int) -> int:
    """How many threads `pid` runs (0 when it is gone)."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def process_rss_bytes(pid: int, part: str = "VmRSS") -> int:
    """Resident memory of `pid` in bytes (0 when it is gone): all of it (VmRSS), or one part of it:
    RssAnon (its own heap and stacks), RssShmem (shared memory it maps: tritonserver maps every
    stub's region, so a large request counts there until the region is given back), RssFile."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith(f"{part}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
