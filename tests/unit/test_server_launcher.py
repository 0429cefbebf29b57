"""runtime/server.py: what a server started through `dying_with_parent` inherits, and the log tail
shown when it dies."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

STARTER = """\
import signal, subprocess, sys
from bionemo_export.runtime.server import dying_with_parent
signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a script's `cmd &` does
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
# Not `sh`: dash clears its signal mask when it starts.
command = [sys.executable, "-c", "import sys; sys.stdout.write(open('/proc/self/status').read())"]
sys.stdout.write(subprocess.run(dying_with_parent(command), capture_output=True, text=True, check=True).stdout)
"""


def _signal_sets(status: str) -> dict[str, int]:
    """{"SigBlk": mask, "SigIgn": mask} from /proc/<pid>/status lines (bit n-1 is signal n)."""
    return {name: int(value, 16) for name, value in (line.split(":") for line in status.splitlines())
            if name in ("SigBlk", "SigIgn")}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the launcher is Linux-only (prctl)")
def test_a_launched_server_hears_the_stop_signals_its_starter_ignored_or_blocked():
    starter = subprocess.run([sys.executable, "-c", STARTER], capture_output=True, text=True, timeout=60)
    assert starter.returncode == 0, starter.stderr
    sets = _signal_sets(starter.stdout)
    for signum in (signal.SIGINT, signal.SIGTERM):
        bit = 1 << (signum - 1)
        assert not sets["SigBlk"] & bit, f"{signum.name} is still blocked in the launched command"
        assert not sets["SigIgn"] & bit, f"{signum.name} is still ignored in the launched command"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the launcher is Linux-only (prctl)")
def test_a_command_the_launcher_cannot_run_is_named(tmp_path):
    """A failed start shows the server's log: it names the binary (a CI run's cache linked to an
    environment deleted since showed only a traceback from os.execvp)."""
    from bionemo_export.runtime.server import dying_with_parent

    binary = tmp_path / "bin" / "tritonserver"
    binary.parent.mkdir()
    binary.symlink_to(tmp_path / "deleted-venv" / "tritonserver")
    run = subprocess.run(dying_with_parent([str(binary), "--model-repository", "x"]), capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 127
    assert run.stderr == f"cannot run {binary}: No such file or directory\n"


# The end of tritonserver's log when the Python backend aborted under load (CI, 2026-11-28), shortened.
DYING_LOG = """\
W1128 13:11:16.843829 13855 pinned_memory_manager.cc:170] "failed to allocate pinned system memory"
terminate called after throwing an instance of 'boost::interprocess::lock_exception'
  what():  boost::interprocess::lock_exception
Signal (6) received.
 0# 0x00005639598D452D in /opt/tritonserver/bin/tritonserver
 1# 0x00007F9D77A5A050 in /lib/x86_64-linux-gnu/libc.so.6
 3# gsignal in /lib/x86_64-linux-gnu/libc.so.6
19# 0x00007F9D77B278EC in /lib/x86_64-linux-gnu/libc.so.6
"""


def test_a_dying_servers_log_tail_says_why_not_where():
    """serve's crash message shows the server's last lines: the numbered frames (addresses in
    stripped libraries) are left out, so the lines that name the cause are in them."""
    from bionemo_export.runtime.server import without_backtrace

    tail = without_backtrace(DYING_LOG.splitlines())[-3:]
    assert tail == ["terminate called after throwing an instance of 'boost::interprocess::lock_exception'",
                    "  what():  boost::interprocess::lock_exception", "Signal (6) received."]
    assert without_backtrace(["I1128 model 'x' 1# loaded"]) == ["I1128 model 'x' 1# loaded"]


def test_free_ports_come_from_below_the_ephemeral_range_and_skip_taken_ones(tmp_path, monkeypatch):
    """Below the range the kernel draws outgoing connections' local ports from, a port freed by a
    killed server cannot be taken by some client's connection before the server is started again."""
    import random
    import socket

    from bionemo_export.runtime import server

    if not server.EPHEMERAL_RANGE.is_file():
        pytest.skip("a Linux host's ephemeral port range")
    real_start = int(server.EPHEMERAL_RANGE.read_text().split()[0])
    ephemeral = tmp_path / "ip_local_port_range"
    ephemeral.write_text("32768\t60999\n")
    monkeypatch.setattr(server, "EPHEMERAL_RANGE", ephemeral)
    ports = server.free_ports(3)
    assert len(set(ports)) == 3 and all(server.LISTENING_PORTS_FROM <= port < 32768 for port in ports)

    with socket.socket() as taken:
        taken.bind((server.LOOPBACK, 0))
        taken.listen()
        busy = taken.getsockname()[1]
        drawn = random.sample
        monkeypatch.setattr(random, "sample", lambda population, k: [busy, *drawn(population, k - 1)])
        [port] = server.free_ports(1)
        assert port != busy and server.LISTENING_PORTS_FROM <= port < 32768

    ephemeral.write_text("15500\t60999\n")  # too few ports below the range: the kernel's choice
    assert all(port >= real_start for port in server.free_ports(2))
    monkeypatch.setattr(server, "EPHEMERAL_RANGE", tmp_path / "absent")  # not Linux: the kernel's choice
    assert len(set(server.free_ports(2))) == 2


def test_a_server_object_makes_its_log_folder_only_when_its_log_is_asked_for(tmp_path, monkeypatch):
    """Made without a log file, a TritonServer asked only for its command line leaves nothing on
    disk (a test or a tool that never starts or closes it leaked an empty folder in /tmp each
    time); its log's folder is made when first needed and removed by close()."""
    import tempfile

    from bionemo_export.runtime.discovery import TritonInstall
    from bionemo_export.runtime.server import TritonServer

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    (tmp_path / "repo").mkdir()
    install = TritonInstall(binary=tmp_path / "tritonserver", backend_directory=tmp_path / "backends",
                            source="explicit")
    server = TritonServer(tmp_path / "repo", install=install)
    assert f"--model-repository={tmp_path / 'repo'}" in server.command()
    assert list((tmp_path / "tmp").iterdir()) == []
    log = server.log_file
    assert log.name == "tritonserver.log" and log.parent.parent == tmp_path / "tmp" and log.parent.is_dir()
    assert server.log_file == log  # one folder, made once
    server.close()
    assert list((tmp_path / "tmp").iterdir()) == []
    given = TritonServer(tmp_path / "repo", install=install, log_file=tmp_path / "server.log")
    assert given.log_file == tmp_path / "server.log" and list((tmp_path / "tmp").iterdir()) == []
