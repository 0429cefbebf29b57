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
tests read it to find the stubs to end. The process table itself is read by bionemo_export/procfs.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from bionemo_export import procfs

SHARED_MEMORY_DIR = Path("/dev/shm")
"""Where the Python backend creates its shared-memory regions (shm_open names)."""
STUB_BINARY = "triton_python_backend_stub"
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


def server_stubs(server_pid: int, model: str | None = None) -> list[Stub]:
    """The stub processes of a tritonserver (of `model` only, if given), zombies included."""
    stubs = []
    for child in procfs.children(server_pid):
        argv = procfs.command_line(child.pid)
        if argv is None:  # gone meanwhile, or not ours to read
            continue
        if child.zombie:  # a zombie's command line is empty: the stub is known by its name in stat
            if not STUB_BINARY.startswith(child.command):
                continue
            stubs.append(Stub(child.pid, "", "", "", True, 0))
            continue
        if len(argv) <= _MODEL_FILE or not argv[0].endswith(STUB_BINARY):
            continue
        folder = Path(argv[_MODEL_FILE]).parent.parent.name
        if model is not None and folder != model:
            continue
        stubs.append(Stub(
            pid=child.pid, model=folder,
            instance=argv[_INSTANCE] if len(argv) > _INSTANCE else "",
            region=argv[_REGION] if len(argv) > _REGION else "",
            zombie=False,
            cpu_ticks=child.cpu_ticks,
        ))
    if model is not None:  # a zombie's model cannot be told
        stubs = [stub for stub in stubs if not stub.zombie]
    return stubs


def live_stubs(server_pid: int, model: str | None = None) -> list[Stub]:
    """The running (not zombie) stubs of a tritonserver, of `model` only if given."""
    return [stub for stub in server_stubs(server_pid, model) if not stub.zombie]


def describe_stubs(server_pid: int) -> list[str]:
    """One line per live stub of a tritonserver: its instance, pid, state, CPU seconds, threads and
    the kernel function it sleeps in. Written into the error of a server that never became ready,
    so that a load that hangs says where (a stub whose CPU time stays put in a futex waits on a
    lock; one whose CPU time climbs is still working)."""
    ticks_per_second = os.sysconf("SC_CLK_TCK")
    lines = []
    for stub in live_stubs(server_pid):
        stat = procfs.process_stat(stub.pid)
        if stat is None:
            continue
        lines.append(f"{stub.instance or stub.model} (pid {stub.pid}): state {stat.state}, "
                     f"{stat.cpu_ticks / ticks_per_second:.1f} s CPU, {procfs.threads(stub.pid)} threads, "
                     f"waiting in {procfs.wait_channel(stub.pid) or '?'}")
    return lines
