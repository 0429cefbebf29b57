"""Whether a stub died while tritonserver loaded a Python-backend model: a load Triton 2.51 never ends.

When a stub of the new instances dies before the load returns, the Python backend waits for it for
good (measured: a load still pending after 90 s), so the supervisor (runtime/supervisor.py) watches
the server's stubs while a load runs and asks for a tritonserver restart instead of waiting.

What one load starts, measured on Triton 2.51 (Python backend r24.10) by reading the server's
children every 2 ms through a reload:
1. a `sh -c <stub binary> > /dev/null 2>&1` check before each stub it launches, ended and reaped
   within ~15 ms (not a stub: it is never counted here);
2. the auto-complete stub, named after the model itself (it runs `auto_complete_config` and ends:
   1.3-1.8 s on a tiny model);
3. one stub per instance, named <group name>_<index>, all launched within ~10 ms of each other;
4. then Triton ends the instances the load replaces (their stubs turn zombie and are reaped).

So a lost stub is a new instance's stub seen alive and then gone, a zombie stub no look saw start,
or an instance that has no stub while nothing moves: no stub of the load starts, ends or uses CPU
for MISSING_STUB_S and no auto-complete stub runs (a stub killed within milliseconds of starting,
before any look saw it). An earlier version took any child the server reaped that no look explained
for a lost stub: the launch checks of step 1 are such children, so every reload looked lost, and a
reload that took over 5 s more to return (CI's loaded 2 cores) restarted tritonserver.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .stubs import Stub

MISSING_STUB_S = 10.0
"""How long a load may leave an instance without a stub while nothing else moves. A healthy load
fills that gap in milliseconds (step 2 to step 3 above: 25 ms measured)."""


def instance_names(model: str, config: dict) -> set[str]:
    """The instances a Python-backend model runs, by Triton's names (<group name>_<index>, the group
    named <model>_<group> unless the config names it), from its configuration (Triton's JSON); empty
    for models without stubs (ensembles, Triton's own runtimes)."""
    if config.get("backend") != "python":
        return set()
    groups = config.get("instance_group") or []
    return {f"{group.get('name') or f'{model}_{g}'}_{i}"
            for g, group in enumerate(groups) for i in range(int(group.get("count", 1)))}


@dataclass
class LoadWatch:
    """Successive looks at a server's stubs while `model` loads (see the module docstring)."""

    model: str
    expected: int
    """How many instances the load starts (0: a model without stubs, where nothing can be missing)."""
    old: set[int]
    """The model's live stubs and every zombie stub of the server when the load began: the
    instances the load replaces and those Triton already keeps. Forgotten once reaped."""
    moved_at: float
    """When a look last saw a stub of the load start, end or use CPU."""
    launchers: set[int] = field(default_factory=set)
    """Auto-complete stubs seen (named after the model): they end by design."""
    new: set[int] = field(default_factory=set)
    """Stubs of the new instances seen alive."""
    activity: tuple[frozenset[int], int] = (frozenset(), 0)
    """The load's live stubs and their CPU ticks, at the last look."""
    reason: str = ""
    """What the look that found a stub lost saw."""

    @classmethod
    def begin(cls, model: str, expected: int, stubs: Iterable[Stub], now: float) -> LoadWatch:
        """A watch from the server's stubs when the load began."""
        old = {stub.pid for stub in stubs if stub.zombie or stub.model == model}
        return cls(model, expected, old, now)

    def stub_lost(self, stubs: Iterable[Stub], now: float) -> bool:
        """One look at the server's stubs (zombies included): whether a stub of the load is lost."""
        stubs = list(stubs)
        live = {stub.pid: stub for stub in stubs if not stub.zombie and stub.model == self.model}
        dead = {stub.pid for stub in stubs if stub.zombie}
        self.old &= set(live) | dead
        fresh = {pid: stub for pid, stub in live.items() if pid not in self.old}
        self.launchers |= {pid for pid, stub in fresh.items() if stub.instance == self.model}
        instances = {pid for pid in fresh if pid not in self.launchers}
        self.new |= instances
        activity = (frozenset(fresh), sum(stub.cpu_ticks for stub in fresh.values()))
        if activity != self.activity:
            self.activity, self.moved_at = activity, now
        ended = (self.new - set(live)) | (dead - self.old - self.launchers)
        still = now - self.moved_at
        if ended:
            self.reason = f"stub {min(ended)} of the new instances ended"
        elif len(instances) < self.expected and not self.launchers & set(fresh) and still >= MISSING_STUB_S:
            self.reason = (f"{self.expected - len(instances)} of its {self.expected} new instances had no stub "
                           f"for {still:.0f} s (a stub killed as it started)")
        return bool(self.reason)
