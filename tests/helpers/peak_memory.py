"""Run the CLI in a child process and read its peak resident memory, as the kernel counts it.

Not getrusage's ru_maxrss from the parent: Linux carries the high-water mark of the memory the
child had before exec (the parent's, copied or shared by fork/vfork) into it, so a child of a
1.6 GB test process reports 1.6 GB whatever it does. The child reads VmHWM from its own
/proc/self/status at exit instead: the peak of its own address space since exec.
"""

from __future__ import annotations

import subprocess
import sys

_WRAPPER = """\
import atexit, runpy, sys

def report():
    with open("/proc/self/status") as status:
        peak = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    sys.stderr.write(f"\\nPEAK_RSS_KB {peak}\\n")

atexit.register(report)
sys.argv = ["bionemo-export", *sys.argv[1:]]
runpy.run_module("bionemo_export.cli.main", run_name="__main__", alter_sys=True)
"""


def cli_peak_rss(arguments: list[str], env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """(exit status, stdout, peak RSS in MB) of `bionemo-export <arguments>` run as a child."""
    result = subprocess.run([sys.executable, "-c", _WRAPPER, *arguments], capture_output=True, text=True, env=env)
    marks = [line for line in result.stderr.splitlines() if line.startswith("PEAK_RSS_KB ")]
    assert marks, f"the child reported no peak:\n{result.stdout}\n{result.stderr[-3000:]}"
    return result.returncode, result.stdout, int(marks[-1].split()[1]) / 1024
