"""runtime/server.py's `dying_with_parent` launcher: what a server started through it inherits."""

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
