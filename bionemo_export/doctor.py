"""Inspect this host: what bionemo-export can use to export, serve and benchmark, and what is missing.

Each check is a `Check` with a status, what was found, the command that fixes it and the jobs
(`Job`: build, serve, bench) that need it, so the CLI renders a table and a verdict per job, and
tests can assert on the same data. A host does not need every job: NVIDIA's Triton container with
the base install serves and has no torch, so `missing_for(checks, Job.SERVE)` is empty there while
building lacks torch, onnx, transformers and Model Navigator.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import mmap
import os
import shutil
import subprocess
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from bionemo_export.runtime.discovery import TritonNotFoundError, find_tritonserver
from bionemo_export.runtime.perf_analyzer import PerfAnalyzerNotFoundError, find_perf_analyzer
from bionemo_export.runtime.server import TritonStartError, probe_server

SETUP_FIX = "bash scripts/setup.sh"


class Job(StrEnum):
    """What a host may be set up to do; each check names the jobs that cannot run without it."""

    BUILD = "build"
    """Export checkpoints into repositories (build, inspect, verify, dev-server): PyTorch and the exporters."""
    SERVE = "serve"
    """Serve repositories and talk to them (serve, health, client): tritonserver and its client."""
    BENCH = "bench"
    """Measure served models (bench): perf_analyzer and Triton's client."""


BUILD, SERVE, BENCH = (Job.BUILD,), (Job.SERVE,), (Job.BENCH,)


@dataclass(frozen=True)
class Check:
    """One component of the host: whether it is usable, what was found, how to fix it."""

    name: str
    ok: bool
    found: str
    fix: str = ""
    needed_for: tuple[Job, ...] = ()
    """The jobs that cannot run without it; empty for optional components (GPU, TensorRT, object
    storage): their absence is reported, not an error."""

    @property
    def required(self) -> bool:
        """Whether some job needs it."""
        return bool(self.needed_for)


def missing_for(checks: Sequence[Check], job: Job) -> list[str]:
    """The components `job` needs that this host lacks, in the checks' order (empty: ready)."""
    return [check.name for check in checks if job in check.needed_for and not check.ok]


def _package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_tritonserver(explicit: str | None = None, probe: bool = True) -> Check:
    try:
        install = find_tritonserver(explicit)
    except TritonNotFoundError as err:
        return Check("tritonserver", False, str(err).splitlines()[0], SETUP_FIX + "  (or --tritonserver PATH)",
                     SERVE)
    version = install.version
    if probe:
        try:
            version = probe_server(install)["version"]
        except (TritonStartError, OSError) as err:
            return Check("tritonserver", False, f"{install.binary} does not start: {str(err).splitlines()[0]}",
                         "see `bionemo-export serve` output and the server log", SERVE)
    backends = ", ".join(install.backends) or "none"
    return Check(
        "tritonserver",
        "python" in install.backends,
        f"{version or 'unknown version'} ({install.source}) {install.binary}\nbackends: {backends}",
        "" if "python" in install.backends else "the python backend is missing from " + str(install.backend_directory),
        SERVE,
    )


# Triton's file-system classes in libtritonserver: a build without the feature lacks the class.
OBJECT_STORES = {"s3://": b"S3FileSystem", "gs://": b"GCSFileSystem", "as://": b"ASFileSystem"}


def object_stores(install) -> list[str] | None:
    """The repository locations besides local folders that this tritonserver reads itself (read
    from its library's symbols), or None when its libtritonserver cannot be found."""
    folders = [install.binary.parent.parent / "lib",
               *(Path(d) for d in install.env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d)]
    library = next((lib for folder in folders if folder.is_dir()
                    for lib in sorted(folder.glob("libtritonserver*.so"))), None)
    if library is None:
        return None
    with open(library, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return [scheme for scheme, symbol in OBJECT_STORES.items() if data.find(symbol) != -1]


def check_object_storage(explicit: str | None = None) -> Check:
    try:
        stores = object_stores(find_tritonserver(explicit))
    except TritonNotFoundError:
        stores = None
    if not stores:
        return Check("object storage", False, "no s3:// support found in this tritonserver" if stores == [] else
                     "libtritonserver not found: cannot tell", "serve s3:// repositories with NVIDIA's container: "
                     "tritonserver --model-repository=s3://bucket/path")
    return Check("object storage", True, f"{', '.join(stores)} repositories, read by tritonserver itself "
                 "(bionemo-export serve s3://...; credentials from AWS_* variables)")


def check_navigator() -> Check:
    """Model Navigator, imported the way the exporter imports it: its import refuses a process
    whose multiprocessing start method is already "fork", which the exporter sets to "spawn"
    around it (a plain import here failed after any earlier fork in the same process)."""
    from bionemo_export.exporters.navigator import navigator_problem

    problem = navigator_problem()
    if problem is not None:
        return Check("Model Navigator", False, f"not importable: {problem}",
                     "pip install --no-deps triton-model-navigator==0.14.0 (see scripts/setup.sh)", BUILD)
    return Check("Model Navigator", True, _package_version("triton-model-navigator") or "unknown version",
                 needed_for=BUILD)


def check_perf_analyzer() -> Check:
    try:
        pa = find_perf_analyzer()
    except PerfAnalyzerNotFoundError as err:
        return Check("perf_analyzer", False, str(err).splitlines()[0], SETUP_FIX, BENCH)
    return Check("perf_analyzer", True, f"{pa.version} {pa.binary}", needed_for=BENCH)


def check_python_package(name: str, module: str, distribution: str, needed_for: tuple[Job, ...] = (),
                         fix: str = SETUP_FIX, detail: Callable[[object], str] | None = None) -> Check:
    """Whether `module` imports (its distribution's version when it does); `needed_for`: the jobs
    that need it (none: optional)."""
    try:
        with warnings.catch_warnings():
            # torch warns about pynvml (a Model Navigator requirement) on every import.
            warnings.simplefilter("ignore")
            imported = importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - any import failure means "not usable"
        return Check(name, False, f"not importable: {type(err).__name__}: {err}", fix, needed_for)
    found = _package_version(distribution) or getattr(imported, "__version__", "unknown version")
    if detail is not None:
        found = f"{found}; {detail(imported)}"
    return Check(name, True, found, needed_for=needed_for)


def _ort_providers(ort: object) -> str:
    return "providers: " + ", ".join(ort.get_available_providers())  # type: ignore[attr-defined]


def _torch_devices(torch: object) -> str:
    return "CUDA available" if torch.cuda.is_available() else "CPU only"  # type: ignore[attr-defined]


def check_gpu() -> Check:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            if out.returncode == 0 and out.stdout.strip():
                return Check("GPU", True, out.stdout.strip().replace("\n", "; "))
        except (OSError, subprocess.TimeoutExpired):
            pass
    return Check("GPU", False, "none (CPU execution; TensorRT export unavailable)",
                 "optional: run on a host with an NVIDIA GPU and drivers")


def check_cpu() -> Check:
    """This host's CPU as the served models see it (serving/host.py): the instruction-set features
    that decide ONNX Runtime's kernels, and so which int8 graph a model opens and what its golden
    check measures here."""
    from bionemo_export.serving.host import cpu_description, describe_cpu

    cpu = cpu_description()
    fix = "" if cpu["vnni"] else ("int8 repositories open their no-VNNI graph here (exact on every CPU, slower than "
                                  "the VNNI one); int8 repositories built before it existed are refused by their "
                                  "golden check on this host")
    return Check("CPU", True, describe_cpu(cpu), fix)


def run_checks(tritonserver: str | None = None, probe: bool = True) -> list[Check]:
    """All checks, in the order the table shows them."""
    return [
        check_cpu(),
        check_tritonserver(tritonserver, probe=probe),
        check_object_storage(tritonserver),
        check_perf_analyzer(),
        # serve: health and client speak to the server with it; bench reads the server's statistics.
        check_python_package("tritonclient", "tritonclient.grpc", "tritonclient", (Job.SERVE, Job.BENCH)),
        check_navigator(),
        check_python_package("onnx", "onnx", "onnx", BUILD),
        # Serving needs it only where a --backend python repository's models run their graphs: in
        # the server's Python, which may not be this one (the fix says so).
        check_python_package("onnxruntime", "onnxruntime", "onnxruntime", BUILD, detail=_ort_providers,
                             fix=f"{SETUP_FIX}  (serving a --backend python repository needs it in the server's "
                                 "Python too: pip install onnxruntime)"),
        check_python_package("torch", "torch", "torch", BUILD, detail=_torch_devices,
                             fix="pip install torch==2.13.0 (see scripts/setup.sh)"),
        check_python_package("transformers", "transformers", "transformers", BUILD),
        check_python_package("TensorRT", "tensorrt", "tensorrt",
                             fix="optional: builds the engines of --backend tensorrt repositories "
                                 "(`bionemo-export engines build`) on a GPU host, e.g. in NVIDIA's Triton container"),
        check_gpu(),
    ]
