"""Find a working `perf_analyzer` (Triton's load generator) and run it.

`tritonclient[all]` wheels install a real `perf_analyzer` next to the Python interpreter; it
links `libcudart.so.12` even on CPU hosts, which the `nvidia-cuda-runtime-cu12` wheel provides
(its folder must be on LD_LIBRARY_PATH), and `libb64.so.0d` from Debian's libb64-0d.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bionemo_export.errors import UserError


class PerfAnalyzerNotFoundError(UserError, RuntimeError):
    """No runnable perf_analyzer; the message says what is missing and how to install it."""


@dataclass(frozen=True)
class PerfAnalyzer:
    binary: Path
    env: dict[str, str] = field(default_factory=dict)
    version: str | None = None

    def process_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for key, value in self.env.items():
            env[key] = value + (os.pathsep + env[key] if env.get(key) else "")
        return env

    def run(self, args: list[str], timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        """Run perf_analyzer with `args`; output is captured as text."""
        return subprocess.run(
            [str(self.binary), *args],
            env=self.process_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )


def _cuda_runtime_libdir() -> Path | None:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        libdir = Path(location) / "cuda_runtime" / "lib"
        if libdir.is_dir():
            return libdir
    return None


def _candidates() -> list[Path]:
    found = []
    on_path = shutil.which("perf_analyzer")
    if on_path:
        found.append(Path(on_path))
    # The wheel's script lands next to this interpreter, which need not be on PATH.
    beside_python = Path(sys.executable).parent / "perf_analyzer"
    if beside_python.is_file() and beside_python not in found:
        found.append(beside_python)
    container = Path("/opt/tritonserver/clients/bin/perf_analyzer")
    if container.is_file():
        found.append(container)
    return found


def find_perf_analyzer() -> PerfAnalyzer:
    """Return the first perf_analyzer that actually starts (`--version` succeeds)."""
    env: dict[str, str] = {}
    libdir = _cuda_runtime_libdir()
    if libdir:
        env["LD_LIBRARY_PATH"] = str(libdir)
    failures = []
    for binary in _candidates():
        candidate = PerfAnalyzer(binary=binary, env=env)
        try:
            result = candidate.run(["--version"], timeout=30)
        except (OSError, subprocess.TimeoutExpired) as err:
            failures.append(f"{binary}: {err}")
            continue
        output = (result.stdout + result.stderr).strip()
        match = re.search(r"Perf Analyzer Version (\S+)", output)
        if result.returncode == 0 and match:
            return PerfAnalyzer(binary=binary, env=env, version=match.group(1))
        failures.append(f"{binary}: {output.splitlines()[-1] if output else f'exit code {result.returncode}'}")
    hint = (
        "Install it with `bash scripts/setup.sh` (tritonclient[all]==2.51.0, nvidia-cuda-runtime-cu12 "
        "and the Debian package libb64-0d), or put a perf_analyzer on PATH."
    )
    if failures:
        raise PerfAnalyzerNotFoundError("no working perf_analyzer:\n  " + "\n  ".join(failures) + "\n" + hint)
    raise PerfAnalyzerNotFoundError("perf_analyzer not found. " + hint)
