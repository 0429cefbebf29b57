"""bionemo_export/procfs.py, the one reader of /proc, against real processes this test starts (and
ends), and runtime/stubs.py's view of a tritonserver's stubs built on it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bionemo_export import procfs
from bionemo_export.runtime.stubs import server_stubs

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc only")


def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _gone_pid() -> int:
    """The pid of a process that ran and was reaped (not reused this soon)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_stat_line_is_read_field_by_field_whatever_the_command_holds():
    # Each field its own number (proc(5)'s position), so that reading the wrong one shows.
    numbers = " ".join(str(index) for index in range(4, 53))
    stat = procfs.parse_stat(7, f"7 (a (b) c) Z {numbers}")
    assert stat.command == "a (b) c" and stat.state == "Z" and stat.zombie
    assert (stat.ppid, stat.pgrp) == (4, 5)
    assert (stat.minflt, stat.cminflt, stat.majflt, stat.cmajflt) == (10, 11, 12, 13)
    assert (stat.utime, stat.stime, stat.cutime, stat.cstime) == (14, 15, 16, 17)
    assert stat.cpu_ticks == 14 + 15


def test_a_line_that_is_not_a_stat_line_is_named():
    with pytest.raises(ValueError, match="/proc/9/stat is not a stat line"):
        procfs.parse_stat(9, "9 (cut short")


def test_this_process_as_proc_sees_it():
    stat = procfs.process_stat(os.getpid())
    assert stat is not None
    assert (stat.pid, stat.ppid, stat.pgrp) == (os.getpid(), os.getppid(), os.getpgrp())
    assert not stat.zombie and procfs.alive(os.getpid())
    assert os.getpid() in procfs.pids()
    arguments = procfs.command_line(os.getpid())
    assert arguments is not None and Path(arguments[0]).name.startswith("python")


def test_a_child_is_listed_with_its_arguments_then_as_a_zombie_then_not_at_all():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "first argument", ""])
    try:
        [listed] = [stat for stat in procfs.children(os.getpid()) if stat.pid == child.pid]
        assert not listed.zombie and procfs.alive(child.pid)
        # An empty last argument is kept: only the NUL ending each argument is dropped.
        assert procfs.command_line(child.pid) == [sys.executable, "-c", "import time; time.sleep(60)",
                                                  "first argument", ""]
        child.send_signal(signal.SIGKILL)  # not waited for: a zombie until it is
        _until(lambda: (procfs.process_stat(child.pid) or listed).zombie)
        assert not procfs.alive(child.pid)
        assert procfs.command_line(child.pid) == []  # a zombie's command line is empty
    finally:
        child.kill()
        child.wait()
    assert procfs.process_stat(child.pid) is None and not procfs.alive(child.pid)
    assert child.pid not in [stat.pid for stat in procfs.children(os.getpid())]


def test_alive_answers_for_any_pid_a_record_may_hold_and_without_proc(monkeypatch, tmp_path):
    gone = _gone_pid()
    assert procfs.alive(os.getpid()) and not procfs.alive(gone)
    for not_a_process in (0, -1, 2**70):  # a lock file's or lease's pid is data: never a process group, no error
        assert not procfs.alive(not_a_process)
    monkeypatch.setattr(procfs, "PROC", tmp_path)  # /proc shows nothing (hidepid, not Linux): the kernel is asked
    assert procfs.process_stat(os.getpid()) is None
    assert procfs.alive(os.getpid()) and procfs.alive(1) and not procfs.alive(gone)


def test_a_sleeping_child_says_where_it_waits():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # Once it sleeps, it names the kernel function it sleeps in ("0" or "" while it starts).
        _until(lambda: procfs.wait_channel(child.pid) not in ("", "0"))
        assert "sleep" in procfs.wait_channel(child.pid)  # hrtimer_nanosleep, do_nanosleep, ...
    finally:
        child.kill()
        child.wait()


def test_a_gone_process_has_no_figures():
    pid = _gone_pid()
    assert procfs.wait_channel(pid) == ""
    assert procfs.process_stat(pid) is None and procfs.command_line(pid) is None
    assert procfs.status_value(pid, "Threads") is None
    assert procfs.threads(pid) == 0 and procfs.memory_bytes(pid) == 0


def test_threads_follow_what_the_process_does():
    before = procfs.threads(os.getpid())
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert procfs.threads(os.getpid()) == before + 1
    finally:
        stop.set()
        thread.join()


_GROWER = """
import sys
print("ready", flush=True)
sys.stdin.readline()
block = bytearray(b"\\x01") * (64 << 20)  # written, so every page is touched
print("grown", flush=True)
sys.stdin.readline()
"""


def test_memory_follows_what_a_fresh_process_allocates():
    # A fresh child, not this process: pytest's own heap may hand back pages it already holds
    # (a raised mmap threshold, another allocator), so its resident size need not move.
    child = subprocess.Popen([sys.executable, "-c", _GROWER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline() == "ready\n"
        heap = procfs.memory_bytes(child.pid, "RssAnon")
        assert heap > 0
        child.stdin.write("grow\n")
        child.stdin.flush()
        assert child.stdout.readline() == "grown\n"
        # The kernel may fold per-CPU counts into the figure a little later.
        _until(lambda: procfs.memory_bytes(child.pid, "RssAnon") - heap >= 48 << 20)
        assert procfs.memory_bytes(child.pid) >= procfs.memory_bytes(child.pid, "RssAnon")
    finally:
        child.kill()
        child.wait()
    assert procfs.memory_bytes(child.pid) == 0


def test_host_memory_and_cpu():
    available = procfs.available_memory_bytes()
    assert available is not None and 0 < available <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    model = procfs.cpu_model()
    assert model is None or model.strip() == model != ""


def test_stubs_are_the_children_named_like_the_python_backend_stub(tmp_path):
    """A stand-in started as tritonserver starts a stub (the binary's name, then the model file, the
    shared-memory region, ..., the instance name), as a child of this process."""
    script = tmp_path / "repo" / "mymodel" / "1" / "model.py"
    script.parent.mkdir(parents=True)
    script.write_text("import time\ntime.sleep(60)\n")
    binary = tmp_path / "triton_python_backend_stub"
    binary.symlink_to(sys.executable)  # the process's name (comm) is the link's
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stub = subprocess.Popen([str(binary), str(script), "region_1", "1048576", "1048576", str(os.getpid()),
                             "/backends/python", "ipc", "mymodel_0_1"])
    try:
        _until(lambda: bool(server_stubs(os.getpid())))
        [found] = server_stubs(os.getpid())
        assert (found.pid, found.model, found.region, found.instance, found.zombie) == (
            stub.pid, "mymodel", "region_1", "mymodel_0_1", False)
        assert server_stubs(os.getpid(), "othermodel") == []
        stub.send_signal(signal.SIGKILL)
        _until(lambda: any(s.zombie for s in server_stubs(os.getpid())))
        [dead] = server_stubs(os.getpid())
        assert dead.pid == stub.pid and dead.zombie and dead.model == ""
        assert server_stubs(os.getpid(), "mymodel") == []  # a zombie's model cannot be told
        stub.wait()
        assert server_stubs(os.getpid()) == []
    finally:
        for process in (stub, other):
            process.kill()
            process.wait()
