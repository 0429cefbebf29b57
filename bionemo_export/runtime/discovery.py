"""Find a Triton Inference Server binary, or prepare the one inside the nvidia-pytriton wheel.

A Triton install is more than a binary: it needs a backend directory (where `python`,
`onnxruntime`, `tensorrt` backends live), for the embedded wheel a library path, and for the
Python backend a `PATH` under which the stub process finds this project's Python environment.
`TritonInstall` carries all of that so that starting a server is one call.

Search order (first hit wins): an explicit path, `$TRITONSERVER`, `tritonserver` on `PATH`,
`/opt/tritonserver/bin/tritonserver` (NVIDIA's containers), then the binary shipped in
`nvidia-pytriton`, prepared once in a cache folder.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bionemo_export.errors import UserError

CONTAINER_TRITONSERVER = Path("/opt/tritonserver/bin/tritonserver")

class TritonNotFoundError(UserError, RuntimeError):
    """No usable tritonserver could be found or prepared."""


@dataclass(frozen=True)
class TritonInstall:
    """A tritonserver binary plus everything needed to run it."""

    binary: Path
    backend_directory: Path
    source: str
    """Where it was found: 'explicit', '$TRITONSERVER', 'PATH', 'container' or 'nvidia-pytriton'."""
    cache_directory: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables to set (over the current environment) when starting the server."""
    version: str | None = None
    """The version when a file states it (NVIDIA containers); `probe_server()` asks the server."""

    @property
    def backends(self) -> tuple[str, ...]:
        """Backends present in the backend directory (a backend is a folder with libtriton_<name>.so)."""
        found = []
        if self.backend_directory.is_dir():
            for entry in sorted(self.backend_directory.iterdir()):
                if (entry / f"libtriton_{entry.name}.so").exists():
                    found.append(entry.name)
        return tuple(found)

    def can_load(self, backend: str) -> bool:
        return backend in self.backends

    def process_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment to start the server with: `base` (default: os.environ) plus ours."""
        env = dict(os.environ if base is None else base)
        for key, value in self.env.items():
            if key in ("PATH", "LD_LIBRARY_PATH") and env.get(key):
                env[key] = value + os.pathsep + env[key]
            else:
                env[key] = value
        return env


def default_cache_root() -> Path:
    """Folder for prepared binaries: `$BIONEMO_EXPORT_CACHE` or `~/.cache/bionemo-export`."""
    override = os.environ.get("BIONEMO_EXPORT_CACHE")
    if override:
        return Path(override)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bionemo-export"


def find_tritonserver(explicit: str | os.PathLike[str] | None = None) -> TritonInstall:
    """Return the first usable tritonserver in the documented search order.

    Raises TritonNotFoundError naming every place that was looked at and how to fix it.
    """
    looked = []
    candidates: list[tuple[str, Path | None]] = [
        ("explicit", Path(explicit) if explicit else None),
        ("$TRITONSERVER", Path(os.environ["TRITONSERVER"]) if os.environ.get("TRITONSERVER") else None),
        ("PATH", Path(p) if (p := shutil.which("tritonserver")) else None),
        ("container", CONTAINER_TRITONSERVER),
    ]
    for source, path in candidates:
        if path is None:
            continue
        looked.append(f"{source}: {path}")
        if path.is_file() and os.access(path, os.X_OK):
            return _system_install(path.resolve(), source)
        if source in ("explicit", "$TRITONSERVER"):
            raise TritonNotFoundError(f"tritonserver given as {source} does not exist or is not executable: {path}")
    try:
        return prepare_embedded_tritonserver()
    except TritonNotFoundError as err:
        looked.append(f"nvidia-pytriton: {err}")
    raise TritonNotFoundError(
        "no tritonserver found. Looked at:\n  "
        + "\n  ".join(looked)
        + "\nInstall the project environment (bash scripts/setup.sh, which installs nvidia-pytriton==0.7.0), "
        "pass `tritonserver` PATH, or run inside an NVIDIA Triton container."
    )


def _system_install(binary: Path, source: str) -> TritonInstall:
    # Standard layout: <root>/bin/tritonserver and <root>/backends.
    root = binary.parent.parent
    backends = root / "backends"
    if not backends.is_dir():
        backends = CONTAINER_TRITONSERVER.parent.parent / "backends"
    version = _read_version_file(root)
    return TritonInstall(binary=binary, backend_directory=backends, source=source, version=version,
                         env=_python_stub_env())


def _read_version_file(root: Path) -> str | None:
    # NVIDIA's containers ship /opt/tritonserver/TRITON_VERSION.
    version_file = root / "TRITON_VERSION"
    if version_file.is_file():
        return version_file.read_text().strip() or None
    return None


def _python_stub_env() -> dict[str, str]:
    """Environment under which the Python-backend stub sees this interpreter's packages.

    The stub finds its Python environment through PATH (PYTHONPATH alone does not work), and it
    must load the libpython of the interpreter whose standard library it uses, or some models
    fail with `'_thread.RLock' object has no attribute '_recursion_count'`.
    """
    env = {"PATH": str(Path(sys.executable).parent)}
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:
        env["LD_LIBRARY_PATH"] = libdir
    return env


def _pytriton_package_dir() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonNotFoundError("the nvidia-pytriton package is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def prepare_embedded_tritonserver(cache_root: Path | None = None) -> TritonInstall:
    """Lay out the tritonserver shipped in nvidia-pytriton so that it runs stand-alone.

    The wheel keeps the Python-backend stub per Python version apart from the backend; Triton
    wants it next to `libtriton_python.so`. We build `<cache>/tritonserver-<version>-py3.X-<where>/`
    with symlinks to the wheel's `bin/` and `caches/` and a copy of `backends/` with the right stub,
    once per installed wheel (`<where>` is a digest of the wheel's folder: the links point into one
    environment, and the cache outlives environments); later calls reuse it. The folder is prepared
    under a temporary name and renamed, so concurrent callers never see half of it; one whose links
    no longer lead to the wheel (its environment was deleted and made again elsewhere, or half of it
    was removed by hand) is prepared again.
    """
    package = _pytriton_package_dir()
    # Resolved: the prepared folder is named after, and links to, the wheel's own folder, not a link
    # to it (a virtual environment reached through a symlink) that may go.
    wheel_root = (package / "tritonserver").resolve()
    binary = wheel_root / "bin" / "tritonserver"
    if not binary.is_file():
        raise TritonNotFoundError(f"nvidia-pytriton is installed but has no {binary}")
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = wheel_root / "python_backend_stubs" / py / "triton_python_backend_stub"
    if not stub.is_file():
        raise TritonNotFoundError(f"nvidia-pytriton has no Python-backend stub for Python {py} ({stub})")

    target = embedded_install_folder(cache_root or default_cache_root(), wheel_root, py)
    if not _is_prepared(target, wheel_root):
        _prepare(target, wheel_root, stub)

    env = _python_stub_env()
    libs = package.parent / "nvidia_pytriton.libs"
    if libs.is_dir():
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [env.get("LD_LIBRARY_PATH"), str(libs)]))
    caches = target / "caches"
    return TritonInstall(
        binary=target / "bin" / "tritonserver",
        backend_directory=target / "backends",
        cache_directory=caches if caches.exists() else None,
        source="nvidia-pytriton",
        env=env,
    )


def embedded_install_folder(cache_root: Path, wheel_root: Path, python: str) -> Path:
    """Where the tritonserver of the nvidia-pytriton wheel at `wheel_root` is laid out."""
    version = importlib.metadata.version("nvidia-pytriton")
    where = hashlib.sha256(str(wheel_root.resolve()).encode()).hexdigest()[:12]
    return cache_root / f"tritonserver-pytriton{version}-py{python}-{where}"


def _is_prepared(target: Path, wheel_root: Path) -> bool:
    """Whether `target` was prepared from this wheel and is whole (its binary is the wheel's)."""
    return ((target / "bin").resolve() == (wheel_root / "bin").resolve()
            and (target / "backends" / "python" / "triton_python_backend_stub").is_file())


def _prepare(target: Path, wheel_root: Path, stub: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        # Broken: moved aside first, in one rename, so a concurrent caller sees it whole or not at all.
        aside = Path(tempfile.mkdtemp(prefix=target.name + ".broken.", dir=target.parent))
        try:
            target.rename(aside / "old")
        except OSError:
            pass  # another caller moved it first
        shutil.rmtree(aside, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        (staging / "bin").symlink_to(wheel_root / "bin")
        if (wheel_root / "caches").is_dir():
            (staging / "caches").symlink_to(wheel_root / "caches")
        shutil.copytree(wheel_root / "backends", staging / "backends", symlinks=True)
        shutil.copy2(stub, staging / "backends" / "python" / "triton_python_backend_stub")
        try:
            staging.rename(target)
        except OSError:
            # Another process prepared it first; theirs is as good as ours.
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
