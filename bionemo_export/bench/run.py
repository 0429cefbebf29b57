"""Run the real perf_analyzer against one or more targets and read the server's statistics.

A target is a model repository folder (started here on the embedded tritonserver, free loopback
ports) or the URL of a running server. For every concurrency perf_analyzer runs once per target,
targets interleaved (A c1, B c1, A c8, B c8, ...), with `-f csv`; the server's statistics
endpoint is read before and after each run, so the true server batch size (inference_count /
execution_count) of the model and of each model it runs (ensemble steps, BLS callees) is known.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bionemo_export import procfs
from bionemo_export.client.triton import InferenceError, TritonClient
from bionemo_export.errors import InvalidInputError, UserError
from bionemo_export.model_repository.reader import dependencies
from bionemo_export.runtime import PerfAnalyzer, TritonServer, find_perf_analyzer, find_tritonserver
from bionemo_export.tensors import DType, TensorSpec

from .inputs import InputData, InputSpec, generate_inputs

DEFAULT_CONCURRENCIES = (1, 8, 32)
DEFAULT_WINDOW_S = 5.0  # perf_analyzer --measurement-interval; >= 5 s on small shared hosts
UNSTABLE = "Failed to obtain stable measurement"
TOO_SLOW = "No valid requests recorded within time interval"
"""perf_analyzer's message when no request finished inside a measurement window."""


class BenchError(UserError, RuntimeError):
    """The benchmark could not run (target unreachable, perf_analyzer failed, ...)."""


# -- targets -----------------------------------------------------------------------------------


@dataclass
class Target:
    """What to measure: `model` on a repository folder (served here) or on a running server."""

    model: str
    repository: Path | None = None
    url: str | None = None  # grpc://host:port, http://host:port, or host:port (then `protocol`)
    protocol: str = "grpc"
    label: str = "A"

    def __post_init__(self) -> None:
        if (self.repository is None) == (self.url is None):
            raise InvalidInputError("a target is either a repository folder or a URL")
        if self.url is not None and "://" in self.url:
            scheme, _, address = self.url.partition("://")
            if scheme not in ("grpc", "http"):
                raise InvalidInputError(f"unsupported URL scheme in {self.url!r}: use grpc://host:port or http://host:port")
            self.protocol, self.url = scheme, address.rstrip("/")
        if self.protocol not in ("grpc", "http"):
            raise InvalidInputError(f"protocol must be grpc or http, not {self.protocol!r}")
        if self.repository is not None:
            self.repository = Path(self.repository).resolve()

    @classmethod
    def parse(cls, text: str, model: str, protocol: str = "grpc", label: str = "A") -> Target:
        """A folder that exists is a repository; anything else is a URL."""
        if Path(text).is_dir():
            return cls(model=model, repository=Path(text), protocol=protocol, label=label)
        if "://" not in text and ":" not in text:
            raise InvalidInputError(f"{text!r} is neither a repository folder nor a URL (grpc://host:port)")
        return cls(model=model, url=text, protocol=protocol, label=label)

    @property
    def where(self) -> str:
        return str(self.repository) if self.repository is not None else f"{self.protocol}://{self.url}"


@dataclass
class LiveTarget:
    """A target whose server is reachable: address, client, model facts and its input data."""

    target: Target
    address: str
    client: TritonClient
    server: TritonServer | None
    server_version: str
    inputs: list[TensorSpec]
    composing: list[str]
    max_length: int | None = None
    data: InputData | None = None
    data_path: Path | None = None

    def config(self, model: str) -> dict:
        return self.client.model_config(model)


def model_inputs(client: TritonClient, model: str) -> list[TensorSpec]:
    """The model's inputs from its config (shape without the batch axis when it batches)."""
    config = client.model_config(model)
    specs = []
    for tensor in config.get("input", []):
        dims = tuple(int(d) for d in tensor.get("dims", []))
        specs.append(TensorSpec(tensor["name"], DType.of(tensor.get("data_type", "TYPE_FP32")), dims,
                                bool(tensor.get("optional", False))))
    return specs


def composing_models(client: TritonClient, model: str) -> list[str]:
    """Every model `model` runs (ensemble steps and BLS callees, through those they call), callees
    first (empty for a plain model), from the configurations the server serves."""

    def config_of(name: str) -> dict | None:
        try:
            return client.model_config(name)
        except InferenceError:  # a callee the server does not know: Triton reports it on calls
            return None

    return dependencies(model, config_of)


def repository_max_residues(repository: Path, models: list[str]) -> int | None:
    """The most residues a character tokenizer in the repository accepts (its tokenizer.json
    `max_length` less BOS/EOS), or None when no such tokenizer is found."""
    for name in models:
        for path in sorted((repository / name).glob("*/tokenizer.json")):
            try:
                spec = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(spec, dict) and spec.get("residues") and isinstance(spec.get("max_length"), int):
                special = sum(1 for key in ("bos_token", "eos_token") if spec.get(key))
                return spec["max_length"] - special
    return None


@contextlib.contextmanager
def open_target(target: Target, *, tritonserver: str | None = None, log_dir: Path | None = None,
                start_timeout: float = 300.0) -> Iterator[LiveTarget]:
    """Start the repository on the embedded tritonserver (or reach the URL) and describe the model."""
    server = None
    with contextlib.ExitStack() as stack:
        if target.repository is not None:
            log_file = (log_dir / f"tritonserver_{target.label}.log") if log_dir else None
            server = TritonServer(target.repository, install=find_tritonserver(tritonserver), log_file=log_file)
            server.start(timeout=start_timeout)
            stack.callback(server.close)
            address = server.endpoints.grpc_url if target.protocol == "grpc" else server.endpoints.http_url
        else:
            address = target.url or ""
        client = TritonClient(f"{target.protocol}://{address}")
        stack.callback(client.close)
        try:
            if not client.model_ready(target.model):
                raise BenchError(f"model {target.model!r} is not ready on {target.where}")
            metadata = client.server_metadata()
            inputs = model_inputs(client, target.model)
            composing = composing_models(client, target.model)
        except BenchError:
            raise
        except Exception as err:  # tritonclient raises its own exception types per protocol
            raise BenchError(f"cannot reach {target.model!r} on {target.where}: {err}") from err
        max_length = None
        if target.repository is not None:
            max_length = repository_max_residues(target.repository, [target.model, *composing])
        yield LiveTarget(target, address, client, server, str(metadata.get("version", "?")), inputs, composing,
                         max_length)


# -- server statistics -------------------------------------------------------------------------


@dataclass
class ModelStats:
    """One model's activity during one perf_analyzer run (differences of the server's counters)."""

    name: str
    inferences: int  # items (sequences) run
    executions: int  # batches executed
    requests: int  # successful requests
    failures: int
    queue_us: float  # average per request
    compute_us: float  # average (input + infer + output) per request

    @property
    def batch_size(self) -> float:
        return self.inferences / self.executions if self.executions else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "batch_size": round(self.batch_size, 3)}


def read_statistics(client: TritonClient) -> dict[str, dict[str, int]]:
    """Raw counters of every model (name -> counter -> value); {} when the endpoint refuses."""
    try:
        raw = client.inference_statistics()
    except Exception:  # e.g. PyTriton's protected statistics endpoint
        return {}
    out: dict[str, dict[str, int]] = {}
    for entry in raw.get("model_stats", []):
        stats = entry.get("inference_stats", {})

        def get(key: str, part: str, stats: dict = stats) -> int:  # this entry's stats, bound now
            return int(stats.get(key, {}).get(part, 0) or 0)

        counters = {
            "inferences": int(entry.get("inference_count", 0) or 0),
            "executions": int(entry.get("execution_count", 0) or 0),
            "requests": get("success", "count"),
            "failures": get("fail", "count"),
            "queue_ns": get("queue", "ns"),
            "compute_ns": get("compute_input", "ns") + get("compute_infer", "ns") + get("compute_output", "ns"),
        }
        previous = out.get(entry["name"])
        out[entry["name"]] = counters if previous is None else {k: previous[k] + v for k, v in counters.items()}
    return out


def statistics_delta(before: dict, after: dict) -> list[ModelStats]:
    """Models that ran between two `read_statistics` snapshots."""
    result = []
    for name, now in after.items():
        then = before.get(name, {})
        d = {k: v - then.get(k, 0) for k, v in now.items()}
        if d["inferences"] <= 0 and d["failures"] <= 0:
            continue
        requests = max(d["requests"], 1)
        result.append(ModelStats(name, d["inferences"], d["executions"], d["requests"], d["failures"],
                                 d["queue_ns"] / requests / 1e3, d["compute_ns"] / requests / 1e3))
    return result


def primary_batch_model(model: str, composing: list[str], ran: list[ModelStats]) -> ModelStats | None:
    """The model whose batch size the report shows: the encoder of an ensemble (`*_encoder`),
    else the ensemble's last step that ran, else the model itself."""
    by_name = {m.name: m for m in ran}
    for name in composing:
        if name.endswith("_encoder") and name in by_name:
            return by_name[name]
    for name in reversed(composing):
        if name in by_name and by_name[name].executions:
            return by_name[name]
    return by_name.get(model)


# -- perf_analyzer -----------------------------------------------------------------------------


@dataclass
class ConcurrencyResult:
    concurrency: int
    sequences_per_s: float
    tokens_per_s: float
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    server_batch_size: float | None
    batch_model: str | None
    models: list[ModelStats]
    stable: bool
    csv: str
    seconds: float
    perf_analyzer: dict[str, str] = field(default_factory=dict)  # the CSV row as perf_analyzer wrote it

    def to_dict(self) -> dict:
        data = asdict(self)
        data["models"] = [m.to_dict() for m in self.models]
        return data


@dataclass
class BenchResult:
    """Every concurrency measured on one target."""

    label: str
    target: str
    model: str
    protocol: str
    server_version: str
    perf_analyzer_version: str | None
    inputs: str
    input_notes: list[str]
    mean_length: float
    input_count: int
    window_s: float
    results: list[ConcurrencyResult] = field(default_factory=list)

    def at(self, concurrency: int) -> ConcurrencyResult | None:
        return next((r for r in self.results if r.concurrency == concurrency), None)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["results"] = [r.to_dict() for r in self.results]
        return data


class ProgressHook:
    """Called around each perf_analyzer run; the CLI shows a rich progress display with it."""

    def status(self, message: str) -> None:
        pass

    def run_started(self, label: str, model: str, concurrency: int, index: int, total: int) -> None:
        pass

    def run_finished(self, label: str, result: ConcurrencyResult) -> None:
        pass


def read_csv(path: Path) -> dict[str, str]:
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        raise BenchError(f"perf_analyzer wrote no results to {path}")
    return rows[0]


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_limit(expected_s: float) -> float:
    """How long one perf_analyzer run may go on before it is taken for stalled: a minute more than
    ten times what it should take (a loaded host is slow, not ten times slow)."""
    return 60.0 + 10.0 * expected_s


def _perf_analyzer(pa: PerfAnalyzer, args: list[str], log: Path, timeout: float, attempts: int = 2) -> tuple[int, str]:
    """Run perf_analyzer with `args`, its output appended to `log`; returns its exit code and output.

    A run still going after `timeout` seconds is killed and started again, `attempts` times in all:
    perf_analyzer has been seen to stall for good with the server idle (synchronous requests at
    concurrency 8 with --request-count, on a loaded 2-core host), and a tune must not wait ten
    minutes on that. A run that stalls every time is a BenchError."""
    for _ in range(attempts):
        with open(log, "a") as handle:
            handle.write("$ perf_analyzer " + " ".join(args) + "\n")
            handle.flush()
            start = handle.tell()
            process = subprocess.Popen([str(pa.binary), *args], env=pa.process_env(), stdout=handle,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                handle.write(f"\n[bionemo-export] perf_analyzer still running after {timeout:.0f} s: stopped\n")
                continue
        with open(log) as handle:
            handle.seek(start)
            return code, handle.read()
    raise BenchError(f"perf_analyzer ran longer than {timeout:.0f} s each of {attempts} times and was stopped; "
                     f"see {log}")


def measure(pa: PerfAnalyzer, live: LiveTarget, concurrency: int, *, window_s: float, out_dir: Path,
            stability_percentage: float = 10.0, max_trials: int = 10,
            timeout: float | None = None) -> ConcurrencyResult:
    """One perf_analyzer run at `concurrency`, with the server's counters read around it. `timeout`
    bounds each perf_analyzer run (default: `run_limit` of what the run should take)."""
    assert live.data is not None and live.data_path is not None
    target = live.target
    csv_path = out_dir / f"perf_{target.label}_c{concurrency}.csv"
    log = out_dir / f"perf_analyzer_{target.label}.log"
    csv_path.unlink(missing_ok=True)
    args = [
        "-m", target.model, "-u", live.address, "-i", target.protocol,
        "--input-data", str(live.data_path), "--concurrency-range", str(concurrency),
        "--measurement-interval", str(max(1, int(round(window_s * 1000)))),
        "--stability-percentage", f"{stability_percentage:g}", "--max-trials", str(max_trials),
        "-f", str(csv_path),
    ]
    started = time.monotonic()
    before = read_statistics(live.client)
    # Each trial is one window (perf_analyzer waits for the requests in flight at its end: two windows).
    code, output = _perf_analyzer(pa, args, log, run_limit(2 * window_s * max_trials) if timeout is None else timeout)
    stable = True
    if code != 0 and (UNSTABLE in output or TOO_SLOW in output):
        # No stable window, or requests slower than the window: measure a fixed number of requests
        # instead (about three windows' worth at the rate the server just sustained) and say so in
        # the report.
        stable = False
        done = statistics_delta(before, read_statistics(live.client))
        served = next((m.requests for m in done if m.name == target.model), 0)
        rate = served / max(time.monotonic() - started, 1e-3)
        count = max(int(rate * window_s * 3), 4 * concurrency, 20)
        code, output = _perf_analyzer(pa, [*args, "--request-count", str(count)], log,
                                      run_limit(count / max(rate, 1.0)) if timeout is None else timeout)
    if code != 0 or not csv_path.exists():
        hint = ""
        if "not in the vocabulary" in output or "invalid character" in output:
            hint = ("\nhint: the model does not accept these inputs (random proteins by default); give `file` "
                    "with sequences or SMILES in its alphabet")
        raise BenchError(f"perf_analyzer failed on {target.model} at concurrency {concurrency} "
                         f"(exit code {code}); last lines (full log: {log}):\n{_tail(output)}{hint}")
    ran = statistics_delta(before, read_statistics(live.client))
    row = read_csv(csv_path)
    throughput = float(row["Inferences/Second"])
    primary = primary_batch_model(target.model, live.composing, ran)

    def ms(key: str) -> float:
        value = row.get(key)
        return float(value) / 1000.0 if value not in (None, "") else math.nan

    return ConcurrencyResult(
        concurrency=concurrency,
        sequences_per_s=throughput,
        tokens_per_s=throughput * live.data.mean_length,
        p50_ms=ms("p50 latency"), p90_ms=ms("p90 latency"), p95_ms=ms("p95 latency"), p99_ms=ms("p99 latency"),
        server_batch_size=primary.batch_size if primary else None,
        batch_model=primary.name if primary else None,
        models=ran, stable=stable, csv=str(csv_path), seconds=time.monotonic() - started, perf_analyzer=row,
    )


# -- the benchmark -----------------------------------------------------------------------------


def run_benchmarks(
    targets: list[Target],
    concurrencies: list[int] | tuple[int, ...] = DEFAULT_CONCURRENCIES,
    inputs: InputSpec | None = None,
    duration: float = DEFAULT_WINDOW_S,
    *,
    out_dir: str | Path | None = None,
    stability_percentage: float = 10.0,
    max_trials: int = 10,
    tritonserver: str | None = None,
    progress: ProgressHook | None = None,
    perf_analyzer: PerfAnalyzer | None = None,
) -> list[BenchResult]:
    """Measure every target at every concurrency, interleaved (A c1, B c1, A c8, B c8, ...).

    `duration` is perf_analyzer's measurement window in seconds; each run lasts at least three
    windows (until three in a row agree within `stability_percentage`). The same `inputs` (same
    seed, so the same sequences) go to every target. Raw CSVs, the input JSON and the logs are
    written to `out_dir` (a temporary folder when None).
    """
    if not targets:
        raise InvalidInputError("nothing to measure")
    concurrencies = [int(c) for c in concurrencies]
    if not concurrencies or min(concurrencies) < 1:
        raise InvalidInputError("concurrencies must be positive integers")
    inputs = inputs or InputSpec()
    progress = progress or ProgressHook()
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="bionemo-export-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    pa = perf_analyzer or find_perf_analyzer()
    labels = [t.label for t in targets]
    if len(set(labels)) != len(labels):
        raise InvalidInputError(f"target labels must differ: {labels}")

    with contextlib.ExitStack() as stack:
        live_targets = []
        for target in targets:
            progress.status(f"{target.label}: " + (f"starting tritonserver on {target.repository}"
                                                   if target.repository else f"connecting to {target.where}"))
            live = stack.enter_context(open_target(target, tritonserver=tritonserver, log_dir=out))
            spec = inputs if inputs.max_length is not None else replace(inputs, max_length=live.max_length)
            live.data = generate_inputs(live.inputs, spec)
            live.data_path = live.data.write(out / f"input_data_{target.label}.json")
            live_targets.append(live)
        results = [
            BenchResult(
                label=t.target.label, target=t.target.where, model=t.target.model, protocol=t.target.protocol,
                server_version=t.server_version, perf_analyzer_version=pa.version,
                inputs=t.data.description if t.data else "", input_notes=t.data.notes if t.data else [],
                mean_length=t.data.mean_length if t.data else 0.0, input_count=len(t.data.entries) if t.data else 0,
                window_s=duration,
            )
            for t in live_targets
        ]
        total = len(concurrencies) * len(live_targets)
        index = 0
        for concurrency in concurrencies:
            for live, result in zip(live_targets, results):
                index += 1
                progress.run_started(live.target.label, live.target.model, concurrency, index, total)
                measured = measure(pa, live, concurrency, window_s=duration, out_dir=out,
                                   stability_percentage=stability_percentage, max_trials=max_trials)
                result.results.append(measured)
                progress.run_finished(live.target.label, measured)
        progress.status("done")
    return results


def run_benchmark(
    target: Target | str | Path,
    model: str,
    concurrencies: list[int] | tuple[int, ...] = DEFAULT_CONCURRENCIES,
    inputs: InputSpec | None = None,
    duration: float = DEFAULT_WINDOW_S,
    **kwargs: Any,
) -> BenchResult:
    """Measure `model` on one target (a repository folder, a URL, or a `Target`)."""
    if not isinstance(target, Target):
        target = Target.parse(str(target), model)
    return run_benchmarks([target], concurrencies, inputs, duration, **kwargs)[0]


def environment() -> dict[str, Any]:
    """The machine and the versions that matter for the numbers."""
    import os
    from importlib import metadata

    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": procfs.cpu_model() or platform.processor(),
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "onnxruntime": version("onnxruntime"),
        "tritonclient": version("tritonclient"),
        "nvidia-pytriton": version("nvidia-pytriton"),
    }
