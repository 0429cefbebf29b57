"""Start, watch and stop a real tritonserver process.

`TritonServer` owns exactly one process (and its process group, which holds the Python-backend
stubs it spawns). It binds to loopback unless told otherwise, takes free ports when none are
given, logs to a file, and waits for readiness; when the server dies or never becomes ready the
error quotes the last lines of its log, which is where Triton says why.

What the server leaves behind is cleaned up with it: on Linux the server gets a parent-death
signal, so it stops even when the process that started it is killed with SIGKILL, and the
Python backend's shared-memory regions carry a prefix unique to this server, so `stop()` can
remove the ones a failed start leaks from /dev/shm without touching any other server's.
"""

from __future__ import annotations

import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from bionemo_export.client.triton import TritonClient
from bionemo_export.errors import UserError
from bionemo_export.model_repository.manifest import Manifest

from .discovery import TritonInstall, find_tritonserver
from .object_storage import check_s3_repository, is_s3_uri
from .stubs import SHARED_MEMORY_DIR, describe_stubs, live_stubs

LOOPBACK = "127.0.0.1"

# A frame of the backtrace tritonserver prints when a signal ends it (" 3# gsignal in /lib/...").
_BACKTRACE_FRAME = re.compile(r"^\s*\d+# ")


def without_backtrace(lines: Iterable[str]) -> list[str]:
    """A tritonserver log's lines without the numbered frames of its dying backtrace: addresses in
    stripped libraries, 20 lines that pushed out of a short tail the lines that say why it died
    ("terminate called after throwing an instance of 'boost::interprocess::lock_exception'",
    "Signal (6) received.")."""
    return [line for line in lines if not _BACKTRACE_FRAME.match(line)]


# An error line of Triton's log ("E1121 11:15:29.182 3177 file.cc:642] message") or its final
# "error: creating server: ..." line.
_LOG_ERROR = re.compile(r"^(?:E\d{4} [\d:.]+\s+\d+ [^\]]+\]|error:)\s*(?P<message>.*)$")
# Errors every CPU-only host logs; they say nothing about the repository.
_HARMLESS_ERRORS = ("CudaDriverHelper", "NVML", "DCGM", "CUDA driver")




class TritonStartError(UserError, RuntimeError):
    """The server exited or did not become ready; the message carries its log's last lines."""


class NotAModelRepositoryError(UserError, ValueError):
    """The folder holds no model Triton could serve; the message says what to pass instead."""


def _is_repository(folder: Path) -> bool:
    """A model folder (a subfolder with config.pbtxt) is present, or bionemo-export built it."""
    try:
        if any((child / "config.pbtxt").is_file() for child in folder.iterdir() if child.is_dir()):
            return True
        return Manifest.read(folder).built_by_bionemo_export
    except (OSError, ValueError):  # no manifest, or not one
        return False


def check_model_repository(folder: str | os.PathLike[str]) -> Path | str:
    """Return `folder` when it is a model repository; otherwise raise NotAModelRepositoryError with
    one line that says what is wrong and what to do (naming a subfolder that is one, if any).

    A repository is a folder with at least one subfolder holding a config.pbtxt, or a folder with
    the manifest.json of a bionemo-export build. Triton itself starts on any folder and serves
    nothing, which looks like success until the first request. An s3:// location is checked the
    same way through boto3 when it is installed (S3RepositoryError) and returned as given.
    """
    if is_s3_uri(folder):
        check_s3_repository(str(folder))
        return str(folder)
    folder = Path(folder)
    if not folder.exists():
        raise NotAModelRepositoryError(f"{folder} does not exist: pass the model repository folder "
                                       "or an s3:// location.")
    if not folder.is_dir():
        raise NotAModelRepositoryError(f"{folder} is not a folder: pass the model repository folder.")
    if _is_repository(folder):
        return folder
    inside = sorted(child for child in folder.iterdir() if child.is_dir() and _is_repository(child))
    hint = (f"did you mean {inside[0]}?" if inside else
            "build one with `bionemo-export build repo ... --out DIR` and serve DIR.")
    raise NotAModelRepositoryError(
        f"{folder} is not a model repository (no subfolder has a config.pbtxt): pass the folder that "
        f"holds the model folders; {hint}"
    )


_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
parent, signum = int(sys.argv[1]), int(sys.argv[2])
for stop_signal in (signal.SIGINT, signal.SIGTERM):
    signal.signal(stop_signal, signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))
ctypes.CDLL(None, use_errno=True).prctl(1, signum, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    os.kill(os.getpid(), signum)
try:
    os.execvp(sys.argv[3], sys.argv[3:])
except OSError as err:  # said in the server's log, which a failed start shows: not a bare traceback
    sys.stderr.write(f"cannot run {sys.argv[3]}: {err.strerror}\\n")
    sys.exit(127)
"""


def dying_with_parent(command: list[str], signum: int = signal.SIGTERM) -> list[str]:
    """`command` started so that it receives `signum` when the process starting it dies (Linux):
    a server never outlives the process that started it, even one killed with SIGKILL.

    A short Python launcher sets the parent-death signal (prctl) and execs the command in the same
    process, rather than a `preexec_fn`: a preexec_fn makes subprocess fork() the whole process
    instead of vfork(), and fork() runs every pthread_atfork handler, where grpcio 1.85's waits for
    its own threads. Measured (CI, 3 xdist workers): a test process that had used a gRPC client
    hung in fork() for good while starting its next tritonserver. The launcher also resets SIGINT
    and SIGTERM to their defaults and unblocks them: a launcher that ignored or blocked them (a
    script's `cmd &` ignores SIGINT) must not leave the server deaf to them (ignored dispositions
    and the signal mask survive exec). The signal is tied to the
    *thread* that starts the command: start servers from one that lives as long as they should.
    """
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), str(int(signum)), *command]


def python_backend_stubs(server_pid: int, model: str | None = None) -> list[int]:
    """The process ids of the live Python-backend stubs of a tritonserver (of `model` only, if given)."""
    return [stub.pid for stub in live_stubs(server_pid, model)]


LISTENING_PORTS_FROM = 15000
"""free_ports draws its ports from here up to the start of the kernel's ephemeral range."""
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct TCP ports that are free on `host` right now, drawn at random from below the
    kernel's ephemeral range (Linux; elsewhere, or when that range leaves too few, from the kernel).

    Not from the ephemeral range, where the kernel picks the local port of every outgoing
    connection and of every bind to port 0: a server restarted on its ports (serve, after
    tritonserver died) found its gRPC port taken in the meantime, "Address already in use" (one run
    of the suite, three workers on a busy host). Below that range only a listener asking for that
    very port can take it, and ports are drawn at random there, so two callers rarely draw the same one."""
    bind_host = host if host != "0.0.0.0" else ""
    candidates = _below_ephemeral_range()
    sockets: list[socket.socket] = []
    try:
        while len(sockets) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            port = next(candidates, 0)  # 0: the kernel's choice, once the drawn ones run out
            try:
                sock.bind((bind_host, port))
            except OSError:
                if port == 0:
                    raise
                sockets.pop().close()
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _below_ephemeral_range(tries: int = 200) -> Iterator[int]:
    """Up to `tries` distinct random ports from LISTENING_PORTS_FROM to the ephemeral range's start;
    none where that range is unknown or starts within 1,000 ports of it."""
    try:
        ephemeral_start = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return iter(())
    if ephemeral_start - LISTENING_PORTS_FROM < 1000:
        return iter(())
    return iter(random.sample(range(LISTENING_PORTS_FROM, ephemeral_start), tries))


@dataclass(frozen=True)
class Endpoints:
    """Where a running server listens."""

    host: str
    http_port: int
    grpc_port: int
    metrics_port: int

    @property
    def _client_host(self) -> str:
        # A server bound to every interface is still reached through loopback from here.
        return LOOPBACK if self.host in ("0.0.0.0", "") else self.host

    @property
    def http_url(self) -> str:
        """`host:port` as tritonclient.http expects it."""
        return f"{self._client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """`host:port` as tritonclient.grpc expects it."""
        return f"{self._client_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._client_host}:{self.metrics_port}/metrics"


def _path_without_whitespace(path: Path, temporary: list[Path]) -> Path:
    """`path`, or a symbolic link to it from a fresh temporary folder whose path has no whitespace
    (the folder is added to `temporary`, for the caller to remove)."""
    if not any(character.isspace() for character in str(path)):
        return path
    folder = Path(tempfile.mkdtemp(prefix="bionemo-export-repository-"))
    temporary.append(folder)
    if any(character.isspace() for character in str(folder)):  # a TMPDIR with spaces: nothing to gain
        return path
    link = folder / "models"
    link.symlink_to(path, target_is_directory=True)
    return link


class TritonServer:
    """A tritonserver process serving one model repository.

    Use as a context manager, or call `start()` and `stop()`:

        with TritonServer("model_repository") as server:
            client = tritonclient.grpc.InferenceServerClient(server.endpoints.grpc_url)
    """

    def __init__(
        self,
        model_repository: str | os.PathLike[str],
        *,
        install: TritonInstall | None = None,
        host: str = LOOPBACK,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        log_file: str | os.PathLike[str] | None = None,
        log_verbose: int = 0,
        response_cache_bytes: int | None = None,
        exit_timeout: int = 10,
        extra_args: tuple[str, ...] = (),
        explicit_model_control: bool = True,
        die_with_parent: bool = True,
    ) -> None:
        # An s3:// location goes to tritonserver as given: Triton downloads each model itself.
        self.model_repository: Path | str = (
            str(model_repository) if is_s3_uri(model_repository) else Path(model_repository).resolve())
        if isinstance(self.model_repository, Path) and not self.model_repository.is_dir():
            raise FileNotFoundError(f"model repository not found: {self.model_repository}")
        self.install = install or find_tritonserver()
        free = iter(free_ports(3, host))
        self.endpoints = Endpoints(
            host=host,
            http_port=http_port or next(free),
            grpc_port=grpc_port or next(free),
            metrics_port=metrics_port or next(free),
        )
        self._temporary: list[Path] = []
        """Folders this object made (the log's when none was given, a link's); `close()` removes them."""
        self._log_file = Path(log_file) if log_file is not None else None
        self.log_verbose = log_verbose
        self.response_cache_bytes = response_cache_bytes
        # On SIGTERM Triton waits this long for in-flight requests *and* idle keep-alive client
        # connections before exiting; its default (30 s) makes every shutdown slow.
        self.exit_timeout = exit_timeout
        self.extra_args = tuple(extra_args)
        # Explicit model control with every model loaded at start: the same models as Triton's
        # default mode, plus the repository API (load/unload) that runtime/supervisor.py reloads
        # a broken model through.
        self.explicit_model_control = explicit_model_control
        self.die_with_parent = die_with_parent
        # Unique to this server, so that its leaked regions can be told from other servers'.
        self.shm_prefix = f"bionemo_export_{os.getpid()}_{secrets.token_hex(4)}_"
        self._process: subprocess.Popen[bytes] | None = None
        self.served_path: Path | str = (self.model_repository if isinstance(self.model_repository, str)
                                        else _path_without_whitespace(self.model_repository, self._temporary))
        """The location tritonserver is given: the s3:// location, the folder, or a link to the
        folder when its path has whitespace (the Python backend starts its stubs with a command line
        split on spaces, and a model folder with a space in its path crashes the server:
        "std::invalid_argument: stol")."""

    @property
    def log_file(self) -> Path:
        """The server's log: the file given, or tritonserver.log in a temporary folder made when first
        asked for (an object only asked for its command line makes none), which `close()` removes."""
        if self._log_file is None:
            folder = Path(tempfile.mkdtemp(prefix="bionemo-export-triton-"))
            self._temporary.append(folder)
            self._log_file = folder / "tritonserver.log"
        return self._log_file

    # -- command line -------------------------------------------------------------------------

    def command(self) -> list[str]:
        """The full tritonserver command line this object runs."""
        ep = self.endpoints
        cmd = [
            str(self.install.binary),
            f"--model-repository={self.served_path}",
            f"--backend-directory={self.install.backend_directory}",
            f"--http-address={ep.host}",
            f"--http-port={ep.http_port}",
            f"--grpc-address={ep.host}",
            f"--grpc-port={ep.grpc_port}",
            f"--metrics-address={ep.host}",
            f"--metrics-port={ep.metrics_port}",
            f"--log-verbose={self.log_verbose}",
            f"--exit-timeout-secs={self.exit_timeout}",
            # No GPU here and none needed; keeps Triton from reserving pinned host memory.
            "--pinned-memory-pool-byte-size=0",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            # gRPC keeps a pool of request buffers that never shrinks: each refused 50 MB request
            # grew the server for good (36 -> 362 MB after 8); without the pool it stays flat
            # (~160 MB after any number, measured on Triton 2.51).
            "--grpc-infer-allocation-pool-size=0",
        ]
        if self.explicit_model_control:
            cmd += ["--model-control-mode=explicit", "--load-model=*"]
        if self.response_cache_bytes:
            if self.install.cache_directory is not None:
                cmd.append(f"--cache-directory={self.install.cache_directory}")
            cmd.append(f"--cache-config=local,size={self.response_cache_bytes}")
        cmd.extend(self.extra_args)
        return cmd

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout: float = 120.0) -> TritonServer:
        """Start the server and block until it reports ready (all models loaded)."""
        if self.is_running():
            return self
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_file, "ab")
        try:
            # Own process group: the Python-backend stubs are the server's children and must go
            # with it, and a Ctrl-C in the terminal must reach us first, not the server.
            self._process = subprocess.Popen(
                # SIGTERM, not SIGKILL, when this process dies: Triton then shuts down in order and
                # takes its stubs and their shared memory with it.
                dying_with_parent(self.command()) if self.die_with_parent else self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.install.process_env(),
                start_new_session=True,
            )
        finally:
            log.close()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Poll `/v2/health/ready` until it answers 200; fail early when the process exits."""
        deadline = time.monotonic() + timeout
        url = f"http://{self.endpoints.http_url}/v2/health/ready"
        while True:
            if self._process is None:
                raise TritonStartError("the server was never started")
            code = self._process.poll()
            if code is not None:
                raise TritonStartError(
                    f"tritonserver exited with code {code} while starting.\n{self._log_excerpt()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TritonStartError(
                    f"tritonserver was not ready after {timeout:.0f} s.\n{self._loading_report()}{self._log_excerpt()}"
                )
            time.sleep(0.25)

    def stop(self, grace: float | None = None) -> int | None:
        """Terminate the server (SIGTERM), then kill its process group after `grace` seconds
        (default: Triton's own exit timeout plus 5 s, so a graceful exit is never cut short).

        Returns the exit code, or None when the server was not started.
        """
        process = self._process
        if process is None:
            return None
        if grace is None:
            grace = self.exit_timeout + 5.0
        if process.poll() is None:
            try:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left in the group (the server or its stubs) goes now.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = process.wait()
        self.remove_shared_memory()
        return code

    def shared_memory_regions(self) -> list[Path]:
        """This server's Python-backend regions in /dev/shm (a clean shutdown leaves none; a
        failed start or a killed server leaves one per model instance that got that far)."""
        return sorted(SHARED_MEMORY_DIR.glob(f"{self.shm_prefix}*"))

    def remove_shared_memory(self) -> list[Path]:
        """Unlink this server's leftover shared-memory regions; only call it once the server is
        gone. Returns what was removed."""
        removed = []
        for region in self.shared_memory_regions():
            try:
                region.unlink()
                removed.append(region)
            except FileNotFoundError:
                pass
        return removed

    def close(self) -> None:
        """Stop the server if it runs and remove the temporary folders this object made (its log,
        when no log file was given: read `log_tail()` before)."""
        self.stop()
        for folder in self._temporary:
            shutil.rmtree(folder, ignore_errors=True)
        self._temporary.clear()

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- inspection ---------------------------------------------------------------------------

    def log_tail(self, lines: int = 30) -> str:
        """The log's last `lines` lines, without the frames of the backtrace tritonserver prints when
        it dies on a signal (see `without_backtrace`)."""
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(without_backtrace(text.splitlines())[-lines:])

    def log_errors(self) -> list[str]:
        """Triton's error lines from the log (model load failures and the like), most telling
        first; the CPU-host noise about CUDA, NVML and DCGM is left out."""
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return []
        errors = []
        for line in text.splitlines():
            match = _LOG_ERROR.match(line)
            if not match:
                continue
            message = match.group("message").strip().strip('"')
            # Triton escapes newlines inside its quoted messages.
            message = message.replace("\\n", "\n").strip()
            if any(noise in message for noise in _HARMLESS_ERRORS) or message in errors:
                continue
            errors.append(message)
        return errors

    def _loading_report(self) -> str:
        """What a server that is not ready is still doing: the models its log shows loading and not
        loaded (tritonserver opens its endpoints only once the first loads are over, so its log is
        the only one to ask) and its stubs' processes (runtime/stubs.describe_stubs)."""
        try:
            log = self.log_file.read_text(errors="replace")
        except OSError:
            log = ""
        loaded = set(re.findall(r"successfully loaded '([^']+)'", log))
        loading = [name for name in dict.fromkeys(re.findall(r'"loading: ([^:"]+):', log)) if name not in loaded]
        parts = [f"Models still loading: {', '.join(loading)}"] if loading else []
        if self.pid is not None:
            parts.extend(f"  stub {line}" for line in describe_stubs(self.pid))
        return "\n".join(parts) + "\n" if parts else ""

    def _log_excerpt(self, lines: int = 15) -> str:
        errors = self.log_errors()
        if errors:
            shown = "\n".join("  " + e.replace("\n", "\n    ") for e in errors)
            return f"Errors in the server log:\n{shown}\n(full log: {self.log_file})"
        return f"Last lines of {self.log_file}:\n{self.log_tail(lines)}"

    def client(self, timeout_s: float = 10.0) -> TritonClient:
        """The package's Triton client for this server (HTTP): its metadata, models, inference."""
        return TritonClient(f"http://{self.endpoints.http_url}", timeout_s=timeout_s)

    def metadata(self) -> dict:
        """Server metadata: name, version and supported extensions (`GET /v2`)."""
        with self.client() as client:
            return client.server_metadata()

    def model_states(self) -> list[dict]:
        """Every model in the repository with its state (READY, UNAVAILABLE, ...) and reason."""
        with self.client() as client:
            return client.repository_index()


def probe_server(install: TritonInstall | None = None, timeout: float = 60.0) -> dict:
    """Start `install` on an empty repository and return its `/v2` metadata (name, version,
    extensions). This is the authoritative version: the binary has no --version flag."""
    with tempfile.TemporaryDirectory(prefix="bionemo-export-probe-") as empty:
        repo = Path(empty) / "models"
        repo.mkdir()
        server = TritonServer(repo, install=install, log_file=Path(empty) / "tritonserver.log")
        with server:
            return server.metadata()
