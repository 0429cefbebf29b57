"""Keep a served repository answering without ever taking down a model that is merely busy.

Why not Triton's health endpoints: when a Python-backend stub process dies (killed, out of
memory), Triton 2.51 (Python backend r24.10) neither restarts it nor says so; every request to the
model fails ("Stub process ... is not healthy") while `/v2/health/ready` and the model's ready
endpoint keep answering 200. Why not a probe request alone: a probe waits in the same queue as
real work, so under load it times out on a healthy model; reloading it then failed every queued
request (an earlier version of this module did exactly that).

So liveness comes from what does not queue, and a probe is sent only to an idle model:
- the stub processes (runtime/stubs.py): an instance whose stub is gone is dead, at once;
- Triton's own counters: pending requests (the metrics endpoint) and completed executions (the
  statistics API), plus the stubs' CPU time: a model with work pending that completes executions
  or burns CPU is busy, never dead; one that does neither for `stall_timeout` seconds is hung;
- a probe (one tiny real request) only when the model and everything it calls have nothing
  pending; a probe that times out while other work progressed, or that admission control turned
  away, says busy, not dead.

A dead model is reloaded alone, through Triton's load API with its own configuration (a new
`supervisor_generation` parameter makes Triton build fresh instances): Triton loads the new
instances beside the old, swaps them in, and reloads the ensembles that call the model without a
moment unloaded; callers are never unloaded. Measured on Triton 2.51: a reload before any request
reached the dead stub ends the old instances cleanly (stub reaped, shared memory and threads
released); once a request has failed on a dead stub, Triton keeps the old instances for good
(a zombie, its shared-memory region, ~35 threads each). The supervisor counts what is kept that way
and asks `serve` to restart tritonserver, at an idle moment, when it passes `leak_limit` instances,
so memory stays flat over any number of heals. It also reloads an idle model whose stubs'
shared-memory regions grew past `stub_memory_limit` (one oversized request grows them for good).
A load is watched while it runs: when a stub of the new instances dies before the load returns, the
Python backend waits for it for good (measured: a load still pending after 90 s), so that
(runtime/load_watch.py tells it from what a load starts and ends by design), or a load past
`load_timeout`, asks for a tritonserver restart instead of waiting.

The probe is runtime/probes.py's (the `health` command runs it once per model); the call graph is
the repository reader's (model_repository/reader.py); `Supervisor` runs the checks beside `serve`
(runtime/lifecycle.py).
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from bionemo_export.client.triton import TritonClient
from bionemo_export.model_repository.reader import dependencies

from .load_watch import LoadWatch, instance_names
from .probes import ProbeResult, instance_model, one_line, probe_model, public_models
from .stubs import Stub, server_stubs

# The config parameter whose new value makes Triton's load API build fresh instances of a model
# whose files did not change (a load of an unchanged model is otherwise a no-op).
GENERATION = "supervisor_generation"
# A dead stub still unreaped this long after it was first seen is kept for good (a clean reload
# reaps the old stubs within about 2 s on a tiny model).
KEPT_AFTER_S = 15.0
# How long a load may still take to return (with its error) after a stub of its new instances
# exited: a model whose initialize() fails ends its stub and then answers the load with the error.
LOST_STUB_GRACE_S = 5.0
PENDING_METRIC = re.compile(r'^nv_inference_pending_request_count\{model="(?P<model>[^"]+)",[^}]*\}\s+(?P<value>\S+)$')

Log = Callable[[str], None]


def pending_requests(metrics_url: str, timeout: float = 5.0) -> dict[str, int]:
    """Requests each model holds that are not finished (`nv_inference_pending_request_count`, from
    Triton's metrics endpoint, which answers without waiting behind inference work)."""
    with urllib.request.urlopen(metrics_url, timeout=timeout) as response:
        text = response.read().decode(errors="replace")
    pending: dict[str, int] = {}
    for line in text.splitlines():
        match = PENDING_METRIC.match(line)
        if match:
            pending[match.group("model")] = pending.get(match.group("model"), 0) + int(float(match.group("value")))
    return pending


@dataclass(frozen=True)
class Observation:
    """One look at a server that waits behind no request: pending and completed requests per model,
    and its stub processes (none where the server runs on another host)."""

    pending: dict[str, int]
    completed: dict[str, int]
    stubs: list[Stub] = field(default_factory=list)

    def cpu_ticks(self, model: str) -> int:
        return sum(stub.cpu_ticks for stub in self.stubs if stub.model == model)

    def live_instances(self, model: str) -> set[str]:
        return {stub.instance for stub in self.stubs if stub.model == model and not stub.zombie}

    def progressed_since(self, earlier: Observation, models: Iterable[str]) -> bool:
        """Whether any of `models` finished a request or used CPU between `earlier` and this."""
        return any(self.completed.get(m, 0) != earlier.completed.get(m, 0)
                   or self.cpu_ticks(m) != earlier.cpu_ticks(m) for m in models)


class Supervisor:
    """Keeps the public models of one running server answering (see the module docstring).

    Every `watch_interval` seconds it looks at the stub processes and reloads a model whose
    instance died; every `interval` seconds it also judges each public model with what it calls:
    busy (requests pending and progressing: left alone), hung (pending, no progress for
    `stall_timeout` s: reloaded), idle (probed; a failing probe is asked again, and only a model
    that fails twice with no progress anywhere in its group is reloaded). Each step is one line to
    `log`. A model that still fails after a reload is retried after a doubling pause (at most 5
    minutes). `recycle_reason` is set when the server should be restarted (old instances kept past
    `leak_limit`); `serve` does that. `start()` runs it in a daemon thread; `check()` runs a round.
    """

    def __init__(self, url: str, models: Iterable[str] | None = None, *, metrics_url: str | None = None,
                 interval: float = 10.0, timeout: float = 30.0, load_timeout: float = 300.0,
                 stall_timeout: float = 300.0, watch_interval: float = 1.0, server_pid: int | None = None,
                 leak_limit: int = 8, stub_memory_limit: int = 1 << 30, log: Log = print) -> None:
        self.url = url
        self.metrics_url = metrics_url
        self.server_pid = server_pid
        """The server's process id when it runs on this host: then its stubs are watched."""
        self.watched: list[str] | None = list(models) if models else None
        """The public models to judge; None: those the server lists."""
        self.interval = interval
        self.timeout = timeout
        self.load_timeout = load_timeout
        self.stall_timeout = stall_timeout
        self.watch_interval = min(watch_interval, interval) if interval > 0 else watch_interval
        self.leak_limit = leak_limit
        self.stub_memory_limit = stub_memory_limit
        self.log = log
        self.recycle_reason: str | None = None
        """Why tritonserver should be restarted (set once; `serve` restarts it and a new Supervisor)."""
        self._instances: dict[str, set[str]] = {}
        self._last_progress: dict[str, float] = {}
        self._previous: Observation | None = None
        self._retry_at: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        self._generation = 0
        self._zombies_seen: dict[int, float] = {}
        """Dead stubs by pid -> when first seen: a cleanly reloaded instance's stub is reaped within
        seconds, a kept one never."""
        self._retiring: set[int] = set()
        """Stubs of instances this supervisor replaced: they may run for a few seconds more."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Created by the thread that uses them (the HTTP client is not shared across threads).
        self._probe_client: TritonClient | None = None
        self._control_client: TritonClient | None = None

    # -- clients and what the server says ------------------------------------------------------

    @property
    def probe_client(self) -> TritonClient:
        if self._probe_client is None:
            self._probe_client = TritonClient(self.url, timeout_s=self.timeout)
        return self._probe_client

    @property
    def control_client(self) -> TritonClient:
        if self._control_client is None:
            self._control_client = TritonClient(self.url, timeout_s=self.load_timeout)
        return self._control_client

    def models(self) -> list[str]:
        """The public models to judge: those given, else those the server's index lists."""
        return self.watched if self.watched is not None else public_models(self.probe_client)

    def config_of(self, model: str) -> dict | None:
        """The model's configuration (remembered by the client); None when the server does not
        know the model."""
        try:
            return self.probe_client.model_config(model)
        except Exception:  # unloaded or unknown: no dependencies known
            return None

    def observe(self) -> Observation:
        """Pending and completed requests and the stubs, read without queueing behind work."""
        pending = pending_requests(self.metrics_url) if self.metrics_url else {}
        stubs = server_stubs(self.server_pid) if self.server_pid else []
        return Observation(pending, self.probe_client.completed_executions(), stubs)

    def _group(self, public: str) -> list[str]:
        """A public model and every model it calls."""
        return [public, *dependencies(public, self.config_of)]

    def _reloadable(self, models: Iterable[str]) -> list[str]:
        """The models of `models` that run instances: ensembles have none (Triton reloads them
        with their steps)."""
        return [m for m in models if (self.config_of(m) or {}).get("platform") != "ensemble"]

    # -- the checks ----------------------------------------------------------------------------

    def expected_instances(self, model: str) -> set[str]:
        """The instances a model runs, by Triton's names, from the configuration Triton serves."""
        return instance_names(model, self.config_of(model) or {})

    def watch(self) -> Observation:
        """The quick check: reload every model one of whose instances lost its stub process; ask
        for a restart when old instances pile up. Returns what it saw."""
        seen = self.observe()
        if not self.server_pid:
            return seen
        if self._reload_dead(seen):
            seen = self.observe()
        self._check_memory(seen)
        self._check_leaks(seen)
        return seen

    def _reload_dead(self, seen: Observation) -> bool:
        """Reload, each alone, the models `seen` shows an instance of without its stub process, and
        say whether their public models answer again. Whether any was reloaded."""
        if not self.server_pid:
            return False
        dead: dict[str, set[str]] = {}
        watched = {m for public in self.models() for m in self._group(public)}
        for model in {stub.model for stub in seen.stubs if not stub.zombie} | set(self._instances) | watched:
            live = seen.live_instances(model)
            gone = (self._instances.get(model, set()) | self.expected_instances(model)) - live
            if gone:
                dead[model] = gone
            self._instances.setdefault(model, set()).update(live)
        for model, gone in sorted(dead.items()):
            self.log(f"health: {model}: instance {', '.join(sorted(gone))} died (its stub process is gone); "
                     f"reloading {model} alone")
        if dead:
            self.reload(sorted(dead))
            self._confirm(sorted(dead), self.observe())
        return bool(dead)

    def check(self) -> list[ProbeResult]:
        """One full round: `watch`, then judge every public model (see the class). Returns the
        probes sent (idle models only)."""
        models = self.models()
        for model in models:  # remember every configuration while the models are loaded
            dependencies(model, self.config_of)
        seen = self.watch()
        previous, self._previous = self._previous, seen
        now = time.monotonic()
        results: list[ProbeResult] = []
        for public in models:
            group = self._group(public)
            if any(seen.pending.get(m, 0) for m in group):
                if previous is None or seen.progressed_since(previous, group):
                    self._last_progress[public] = now
                    continue
                stalled = now - self._last_progress.setdefault(public, now)
                if stalled > self.stall_timeout and self._due(public, now):
                    self.log(f"health: {public} has held pending requests for {stalled:.0f} s without finishing "
                             f"one or using CPU: hung; reloading {', '.join(self._reloadable(group))}")
                    self._reload_and_confirm(public, self._reloadable(group))
                continue
            self._last_progress[public] = now
            # Look at the stubs again just before the probe: a request that meets a dead stub makes
            # Triton 2.51 keep that instance for good (a restart's worth of memory), and a stub killed
            # since the round's watch would meet this probe (found under CI's load).
            just_before = self.observe()
            if self._reload_dead(just_before):
                continue
            result, blamed = self._judge_idle(public, group, just_before)
            results.append(result)
            if blamed and self._due(public, now):
                self.log(f"health: {public} does not answer ({result.error}); reloading {', '.join(blamed)}")
                self._reload_and_confirm(public, blamed)
            elif result.ok:
                self._failures.pop(public, None)
                self._retry_at.pop(public, None)
        return results

    def _judge_idle(self, public: str, group: list[str], seen: Observation) -> tuple[ProbeResult, list[str]]:
        """Probe an idle public model (`seen`: the look just before); the models to reload ([] when it
        answered, was turned away by admission control, or other work progressed meanwhile: busy, not
        dead)."""
        for attempt in (1, 2):
            before = seen if attempt == 1 else self.observe()
            result = probe_model(self.probe_client, public)
            if result.ok or result.turned_away:
                return result, []
            if result.dead_instance:
                return result, [instance_model(result.dead_instance)]
            if self.observe().progressed_since(before, group):
                self.log(f"health: {public}'s probe failed ({result.error}) while its models were working: busy, "
                         "not reloaded")
                return result, []
        return result, self._reloadable(group)

    def _confirm(self, reloaded: list[str], seen: Observation) -> None:
        """Probe the idle public models that call a reloaded model (or are one) and say whether
        they answer again; busy ones are left to their work."""
        for public in self.models():
            group = self._group(public)
            if set(reloaded) & set(group) and not any(seen.pending.get(m, 0) for m in group):
                result = probe_model(self.probe_client, public)
                answers = result.ok or result.turned_away
                state = "answers again" if answers else f"still does not answer ({result.error})"
                self.log(f"health: {public} {state} ({result.seconds:.2f} s)")

    def _due(self, public: str, now: float) -> bool:
        return self._retry_at.get(public, 0.0) <= now

    def _reload_and_confirm(self, public: str, models: list[str]) -> None:
        self.reload(models)
        result = probe_model(self.probe_client, public)
        if result.ok or result.turned_away:
            self.log(f"health: {public} answers again ({result.seconds:.2f} s)")
            self._failures.pop(public, None)
            self._retry_at.pop(public, None)
            return
        count = self._failures[public] = self._failures.get(public, 0) + 1
        pause = min(max(self.interval, 1.0) * 2 ** count, 300.0)
        self._retry_at[public] = time.monotonic() + pause
        self.log(f"health: {public} still does not answer ({result.error}); next reload in {pause:.0f} s")

    def reload(self, models: list[str]) -> None:
        """Build fresh instances of `models`, callees first, each loaded beside its old instances
        and swapped in by Triton (nothing that calls them is unloaded)."""
        order: list[str] = []
        for model in models:
            order += [m for m in (*dependencies(model, self.config_of), model) if m in models and m not in order]
        for model in order:
            config = self.config_of(model)
            if config is None:
                self.log(f"health: {model} is not known to the server; not reloaded")
                continue
            self._generation += 1
            config = {**config, "parameters": {**(config.get("parameters") or {}),
                                               GENERATION: {"string_value": str(self._generation)}}}
            start = time.monotonic()
            try:
                if not self._load(model, config):  # a restart was asked for, or serve is stopping
                    if self.recycle_reason:
                        self.log(f"health: {self.recycle_reason}")
                    return
                self.log(f"health: reloaded {model} ({time.monotonic() - start:.1f} s)")
            except Exception as err:
                self.log(f"health: loading {model} failed: {one_line(err)}")
            self._instances.pop(model, None)  # learnt again from the new stubs

    def _load(self, model: str, config: dict) -> bool:
        """Load `model` with `config` in a worker thread while watching the server's stubs. True once
        the load returned (its error is raised); False, with `recycle_reason` set, when it never
        will: a stub died while the load ran (`LoadWatch`) and the load did not return within
        LOST_STUB_GRACE_S, or `load_timeout` passed."""
        def stubs() -> list[Stub]:
            return server_stubs(self.server_pid) if self.server_pid else []

        watch = LoadWatch.begin(model, len(instance_names(model, config)), stubs(), time.monotonic())
        outcome: list[BaseException | None] = []

        def load() -> None:
            try:  # the client's own deadline only ends the thread; the supervisor judges first
                with TritonClient(self.url, timeout_s=self.load_timeout + 60) as client:
                    client.load_model(model, config)
                outcome.append(None)
            except BaseException as err:  # handed to the supervisor's thread
                outcome.append(err)

        worker = threading.Thread(target=load, name=f"bionemo-export-load-{model}", daemon=True)
        worker.start()
        deadline = time.monotonic() + self.load_timeout
        lost_at: float | None = None
        while not self._stop.is_set():
            worker.join(0.05)  # a new stub may live only moments: look often while a load runs
            if not worker.is_alive():
                if outcome and outcome[0] is not None:
                    raise outcome[0]
                return True
            now = time.monotonic()
            if lost_at is None and watch.stub_lost(stubs(), now):
                lost_at = now
            if lost_at is not None and now - lost_at > LOST_STUB_GRACE_S:
                self.recycle_reason = (f"a stub died while {model} loaded ({watch.reason}); Triton 2.51 never "
                                       "finishes such a load, restarting tritonserver does")
                return False
            if now > deadline:
                self.recycle_reason = (f"loading {model} did not finish within {self.load_timeout:g} s; "
                                       "restarting tritonserver")
                return False
        return False

    def _check_memory(self, seen: Observation) -> None:
        """Reload an idle model whose stubs' shared memory grew past `stub_memory_limit`: the
        Python backend never shrinks a region, so one oversized request would keep it for good."""
        if not self.stub_memory_limit:
            return
        grown: dict[str, int] = {}
        for stub in seen.stubs:
            if not stub.zombie and stub.pid not in self._retiring and not seen.pending.get(stub.model, 0):
                size = stub.region_bytes()
                if size > self.stub_memory_limit:
                    grown[stub.model] = max(size, grown.get(stub.model, 0))
        self._retiring.update(stub.pid for stub in seen.stubs if stub.model in grown)
        for model, size in sorted(grown.items()):
            self.log(f"health: {model}'s shared memory grew to {size >> 20} MiB (over {self.stub_memory_limit >> 20} "
                     "MiB, from a large request); reloading it while idle to give it back")
        if grown:
            self.reload(sorted(grown))

    def _check_leaks(self, seen: Observation) -> None:
        """Ask for a server restart once the old instances Triton keeps reach `leak_limit`: when
        the server is idle, or at twice the limit whatever it is doing."""
        now = time.monotonic()
        zombies = {stub.pid for stub in seen.stubs if stub.zombie}
        self._zombies_seen = {pid: self._zombies_seen.get(pid, now) for pid in zombies}
        kept = sum(now - since >= KEPT_AFTER_S for since in self._zombies_seen.values())
        if self.recycle_reason or not self.leak_limit or kept < self.leak_limit:
            return
        idle = not any(seen.pending.values())
        if idle or kept >= 2 * self.leak_limit:
            self.recycle_reason = (f"{kept} dead model instances are kept by tritonserver (requests failed on "
                                   "them before they were reloaded); restarting it gives their memory back")
            self.log(f"health: {self.recycle_reason}")

    # -- in the background ---------------------------------------------------------------------

    def start(self) -> Supervisor:
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
        next_check = time.monotonic() + self.interval
        try:
            while not self._stop.wait(self.watch_interval) and not self.recycle_reason:
                try:
                    if time.monotonic() >= next_check:
                        self.check()
                        next_check = time.monotonic() + self.interval
                    else:
                        self.watch()
                except Exception as err:  # the server may be busy or restarting; never stop watching
                    self.log(f"health: check failed: {one_line(err)}")
        finally:
            for client in (self._probe_client, self._control_client):
                if client is not None:
                    client.close()
