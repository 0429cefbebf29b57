"""Keep a served repository answering: probe its public models with a tiny real request and reload
the ones that fail, with the models to blame, through Triton's repository API.

Why a probe and not Triton's health endpoints: when a Python-backend stub process dies (killed,
out of memory), Triton 2.51 (Python backend r24.10) neither restarts it nor says so; every request
to the model fails ("Stub process ... is not healthy") while `/v2/health/ready`, `/v2/health/live`
and the model's own ready endpoint keep answering 200. Only a real request tells. Unloading the
model and loading it again starts a fresh stub; while it is unloaded its ready endpoint says so.

`probe_model()` is the probe (the `health` command runs it once per model); `Supervisor` runs it
periodically beside `serve` and does the reloads.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from bionemo_export.client.triton import InferenceError, ServerUnreachableError, TritonClient, strings_to_tensor

from .server import python_backend_stubs

# Public models are named <name>_<task> (DESIGN.md, the served API); everything else is internal.
PUBLIC_SUFFIXES = ("_embeddings", "_hiddens", "_decodes", "_samplings")
# Config parameter of a model that calls others through BLS: their names, comma-separated. Triton
# knows an ensemble's steps but not these calls; the repository plan (seq2seq.py) writes it.
BLS_MODELS = "bls_models"
# Optional config parameter of a public model: the sequence its probe sends.
HEALTH_PROBE = "health_probe"
# Valid in every alphabet served here: cysteine for protein models, methane for SMILES models.
PROBE_SEQUENCE = "C"
# How a request to a model instance whose stub process died fails, naming the instance
# (<model>_<group>_<index>): never transient (the Python backend does not restart stubs), so no
# second probe is needed to confirm it, and the model to reload is known.
DEAD_STUB = re.compile(r"Stub process '(?P<instance>[^']+)' is not healthy")
# Unloading a model whose stub died never finishes (Triton 2.51 sends the dead stub a finalize
# message and waits for its answer), and the model's other stubs then stay for good, each holding
# a copy of the model. The model is no longer READY at once, though, and a load beside the stuck
# unload works: so wait this long at most, end the stubs left behind, and load.
UNLOAD_WAIT_S = 5.0

Log = Callable[[str], None]


def is_public(model: str) -> bool:
    return model.endswith(PUBLIC_SUFFIXES)


class ControlClient(TritonClient):
    """A TritonClient that also reads the server's view of its models (metadata, readiness, the
    repository index) and loads and unloads them; over HTTP or gRPC alike, answers as JSON-like
    dicts. Loading and unloading needs a server in explicit model-control mode."""

    def _call(self, method: str, *args: Any) -> Any:
        """Call a tritonclient method that answers JSON over HTTP and protobuf over gRPC; answer
        JSON. Errors are raised as InferenceError or ServerUnreachableError, as for `infer`."""
        kwargs: dict[str, Any] = {}
        if self.url.protocol == "grpc":
            kwargs["client_timeout"] = self.timeout_s
            if method.startswith("get_"):
                kwargs["as_json"] = True
        return self._guarded(args[0] if args else str(self.url),
                             lambda: getattr(self._client, method)(*args, **kwargs))

    def model_metadata(self, model: str) -> dict:
        """Inputs and outputs with datatype and shape (the batch axis included, as -1)."""
        metadata = self._call("get_model_metadata", model)
        for tensor in (*metadata.get("inputs", ()), *metadata.get("outputs", ())):
            tensor["shape"] = [int(d) for d in tensor.get("shape", ())]  # gRPC's JSON writes int64 as text
        return metadata

    def model_ready(self, model: str) -> bool:
        return bool(self._call("is_model_ready", model))

    def repository_index(self) -> list[dict]:
        """Every model of the repository: name, version, state (READY, UNAVAILABLE, ...), reason."""
        index = self._call("get_model_repository_index")
        return index.get("models", []) if isinstance(index, dict) else index

    def load_model(self, model: str) -> None:
        """Load a model (after an unload: with fresh instances); returns once it is loaded."""
        self._call("load_model", model)

    def unload_model(self, model: str) -> None:
        self._call("unload_model", model)


@dataclass(frozen=True)
class ProbeResult:
    """One probe of one model: did it answer, how long it took, and the error if not."""

    model: str
    ok: bool
    seconds: float
    error: str = ""

    def line(self) -> str:
        """One line for people and logs: `ok    esm2_embeddings  0.012 s` or `FAIL  ...  error`."""
        return f"{'ok' if self.ok else 'FAIL':<5} {self.model}  {self.seconds:.3f} s" + (
            f"  {self.error}" if self.error else "")


def _parameter(config: dict, key: str) -> str | None:
    value = (config.get("parameters") or {}).get(key)
    return value.get("string_value") if isinstance(value, dict) else None


def probe_inputs(config: dict, metadata: dict) -> dict[str, np.ndarray]:
    """The smallest valid request for a public model: one sequence (the config's `health_probe`
    parameter, else "C"), with num_samples 1 where the model samples; for a decoder, one position
    of zero hidden states [1, 1, H] with its mask True (H from the model's metadata)."""
    inputs = {tensor["name"]: tensor for tensor in metadata.get("inputs", ())}
    if "hiddens" in inputs:
        hidden_size = inputs["hiddens"]["shape"][-1]
        if hidden_size < 1:
            raise ValueError(f"{metadata.get('name')}: the hiddens input has no fixed hidden size")
        return {"hiddens": np.zeros((1, 1, hidden_size), dtype=np.float32), "mask": np.ones((1, 1), dtype=bool)}
    if "sequences" not in inputs:
        raise ValueError(f"{metadata.get('name')}: no `sequences` or `hiddens` input to probe with")
    probe = {"sequences": strings_to_tensor([_parameter(config, HEALTH_PROBE) or PROBE_SEQUENCE])}
    if "num_samples" in inputs:
        probe["num_samples"] = np.ones((1, 1), dtype=np.int32)
    return probe


def _one_line(err: BaseException) -> str:
    text = str(err) if isinstance(err, (InferenceError, ServerUnreachableError)) else f"{type(err).__name__}: {err}"
    return " ".join(text.split())[:400]


def probe_model(client: ControlClient, model: str) -> ProbeResult:
    """Send `model` its probe request and report whether it answered (within the client's timeout)."""
    start = time.monotonic()
    try:
        client.infer(model, probe_inputs(client.model_config(model), client.model_metadata(model)))
    except Exception as err:  # whatever went wrong, the model did not answer
        return ProbeResult(model, False, time.monotonic() - start, _one_line(err))
    return ProbeResult(model, True, time.monotonic() - start)


def public_models(client: ControlClient, repository: Path | None = None) -> list[str]:
    """The public models: the `public_models` of the repository's manifest.json when there is one,
    else every model of the server's index named like a public one."""
    if repository is not None:
        from bionemo_export.model_repository.manifest import Manifest

        try:
            listed = Manifest.read(repository).public_models
        except (OSError, ValueError):  # no manifest, or not one: ask the server
            listed = None
        if listed:
            return list(listed)
    return list(dict.fromkeys(m["name"] for m in client.repository_index() if is_public(m["name"])))


def dependencies(model: str, config_of: Callable[[str], dict | None]) -> list[str]:
    """Every model `model` calls, directly or through others (ensemble steps; BLS calls named by the
    `bls_models` parameter), each after the models it calls itself: the order to load them in."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        config = config_of(name) or {}
        callees = [step["model_name"] for step in (config.get("ensemble_scheduling") or {}).get("step", ())]
        callees += [callee.strip() for callee in (_parameter(config, BLS_MODELS) or "").split(",") if callee.strip()]
        for callee in callees:
            if callee not in order and callee not in path:  # a cycle is Triton's error to report
                visit(callee, (*path, callee))
                order.append(callee)

    visit(model, (model,))
    return order


def suspects(result: ProbeResult, config_of: Callable[[str], dict | None]) -> list[str]:
    """The models that may have made a probe fail: the one whose stub died, when the error names
    it; otherwise the probed model and every model it calls."""
    match = DEAD_STUB.search(result.error)
    if match:
        model = re.sub(r"_\d+_\d+$", "", match.group("instance"))
        if config_of(model) is not None:
            return [model]
    return [result.model, *dependencies(result.model, config_of)]


def reload_order(broken: Iterable[str], failed: Iterable[str], publics: Iterable[str],
                 config_of: Callable[[str], dict | None]) -> list[str]:
    """The models to reload, callees first: the `broken` ones, the `failed` public models, and
    every public model that calls a broken one, directly or not (it cannot answer while they are
    unloaded, so it is unloaded too and its ready endpoint says so)."""
    broken, failed, publics = list(broken), list(failed), list(publics)
    chosen = {*broken, *failed, *(p for p in publics if set(broken) & set(dependencies(p, config_of)))}
    order: list[str] = []
    for model in (*broken, *failed, *publics):
        if model in chosen:
            order += [m for m in (*dependencies(model, config_of), model) if m in chosen and m not in order]
    return order


class Supervisor:
    """Keeps the public models of one running server answering.

    Every `interval` seconds it probes each public model (`probe_model`, bounded by `timeout`). A
    model fails when its probe fails and so does a second one right after, or at once when the
    error says a stub died. Then the models to blame (`suspects`: the one whose stub died, else
    the failed model and all it calls) and the public models that call them are reloaded
    (`reload_order`): all unloaded, callers first, so that their ready endpoints say not ready;
    loaded again, callees first; and probed again. Each step is one line to `log`. A model that
    still fails is retried after a doubling pause (capped at 5 minutes), not every round.
    `start()` runs it in a daemon thread; `check()` runs one round.
    """

    def __init__(self, url: str, models: Iterable[str] | None = None, *, interval: float = 10.0,
                 timeout: float = 30.0, load_timeout: float = 300.0, server_pid: int | None = None,
                 log: Log = print) -> None:
        self.url = url
        self.server_pid = server_pid
        """The server's process id when it runs on this host: then the stubs a stuck unload leaves
        behind are ended."""
        self._models = list(models) if models else None
        self.interval = interval
        self.timeout = timeout
        self.load_timeout = load_timeout
        self.log = log
        self._retry_at: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Created by the thread that uses them (the HTTP client is not shared across threads).
        self._probe_client: ControlClient | None = None
        self._control_client: ControlClient | None = None

    # -- clients and what the server says ------------------------------------------------------

    @property
    def probe_client(self) -> ControlClient:
        if self._probe_client is None:
            self._probe_client = ControlClient(self.url, timeout_s=self.timeout)
        return self._probe_client

    @property
    def control_client(self) -> ControlClient:
        if self._control_client is None:
            self._control_client = ControlClient(self.url, timeout_s=self.load_timeout)
        return self._control_client

    def models(self) -> list[str]:
        """The public models to probe: those given, else those the server's index lists."""
        return self._models if self._models is not None else public_models(self.probe_client)

    def config_of(self, model: str) -> dict | None:
        """The model's configuration (the client remembers it: an unloaded model's cannot be
        asked for); None when the server does not know the model."""
        try:
            return self.probe_client.model_config(model)
        except Exception:  # unloaded or unknown: no dependencies known
            return None

    # -- one round -----------------------------------------------------------------------------

    def check(self) -> list[ProbeResult]:
        """Probe every public model once; reload what the failures blame (see the class). Returns
        the first probes' results."""
        models = self.models()
        for model in models:  # remember every configuration while the models are loaded
            dependencies(model, self.config_of)
        results = [probe_model(self.probe_client, model) for model in models]
        # A single slow or unlucky answer is not a broken model: ask once more before acting,
        # unless the error says that a stub died.
        failed = [r for r in results if not r.ok and DEAD_STUB.search(r.error)]
        failed += [again for again in (probe_model(self.probe_client, r.model) for r in results
                                       if not r.ok and not DEAD_STUB.search(r.error)) if not again.ok]
        now = time.monotonic()
        due = [r for r in failed if self._retry_at.get(r.model, 0.0) <= now]
        if due:
            for result in due:
                self.log(f"health: {result.model} does not answer ({result.error})")
            broken = list(dict.fromkeys(m for r in due for m in suspects(r, self.config_of)))
            self.reload(broken, [r.model for r in due], models)
        for result in results:
            if result.ok:
                self._failures.pop(result.model, None)
                self._retry_at.pop(result.model, None)
        return results

    def reload(self, broken: list[str], failed: list[str], publics: list[str]) -> list[ProbeResult]:
        """Unload and load the `broken` models, the `failed` public ones and the public models that
        call a broken one (`reload_order`); probe the public ones again."""
        order = reload_order(broken, failed, publics, self.config_of)
        client = self.control_client
        for model in reversed(order):  # callers first: nothing calls a model that is gone
            try:
                client.unload_model(model)
                if not self._wait_unloaded(model):
                    self._end_stuck_stubs(model)
            except Exception as err:
                self.log(f"health: unloading {model} failed: {_one_line(err)}")
        for model in order:
            start = time.monotonic()
            try:
                client.load_model(model)
                self.log(f"health: reloaded {model} ({time.monotonic() - start:.1f} s)")
            except Exception as err:
                self.log(f"health: loading {model} failed: {_one_line(err)}")
        results = [probe_model(self.probe_client, model) for model in order if model in publics]
        for result in results:
            if result.ok:
                self.log(f"health: {result.model} answers again ({result.seconds:.2f} s)")
                continue
            count = self._failures[result.model] = self._failures.get(result.model, 0) + 1
            pause = min(self.interval * 2 ** count, 300.0)
            self._retry_at[result.model] = time.monotonic() + pause
            self.log(f"health: {result.model} still does not answer ({result.error}); next reload in {pause:.0f} s")
        return results

    def _end_stuck_stubs(self, model: str) -> None:
        """The unload of `model` is stuck on a dead stub: end the stubs it leaves behind (before
        the load starts new ones)."""
        stubs = python_backend_stubs(self.server_pid, model) if self.server_pid else []
        for pid in stubs:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        ended = f"; ended the stubs it left (pid {', '.join(map(str, stubs))})" if stubs else ""
        self.log(f"health: {model} is still unloading after {UNLOAD_WAIT_S:g} s (a dead stub never "
                 f"answers){ended}; loading it again beside")

    def _wait_unloaded(self, model: str) -> bool:
        """Wait (at most UNLOAD_WAIT_S) until the index shows `model` neither READY nor UNLOADING:
        Triton's unload returns before the old instances are gone, and loading meanwhile holds two
        copies of the model. Returns whether it got there."""
        deadline = time.monotonic() + UNLOAD_WAIT_S
        while True:
            states = {m["name"]: m.get("state", "") for m in self.control_client.repository_index()}
            if states.get(model) not in ("READY", "UNLOADING"):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    # -- in the background ---------------------------------------------------------------------

    def start(self) -> "Supervisor":
        self._thread = threading.Thread(target=self._run, name="bionemo-export-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self, wait: float = 2.0) -> None:
        """Stop after the current step (a probe or a load may still be under way: not waited for
        beyond `wait` seconds; the thread is a daemon)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                try:
                    self.check()
                except Exception as err:  # the server may be busy or restarting; never stop watching
                    self.log(f"health: check failed: {_one_line(err)}")
        finally:
            for client in (self._probe_client, self._control_client):
                if client is not None:
                    client.close()
