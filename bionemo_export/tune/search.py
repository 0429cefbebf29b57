"""The search: which settings to measure next, which to drop early, which one wins.

It works as Triton Model Analyzer's quick search does, on this tool's settings (space.py): start
from the repository's current settings (measured first: the baseline), and climb. For each
setting of each tuned model in turn, measure the values within two steps either way (a radius of
two, so that a flat step, e.g. 16 rows per call where batches are 11, does not hide a better one
beyond it); the best of them, if it scores better than where the climb stands (by more than
`min_gain`, the noise a shared host shows), is taken and the climb goes on from there along the
same setting; a pass over every setting that moves nothing ends the search, as does the time
budget. A candidate is measured at the highest concurrency first and pruned there
when it falls clearly behind the best (`prune_below`) or breaks the latency bound, so a bad step
costs one perf_analyzer run, not one per concurrency. The winner is measured again beside the
baseline (interleaved, `confirm`), and kept only if it still wins: a tuned repository never serves
worse than the one it came from, on the figures measured on this host.

The candidate's keys are the session's units (session.py `tuned_units`): a model, or a checkpoint
ensemble's K members' models of one role, set alike. The K models of such a unit run side by side
on the host's cores, so its settings range over the values of a host with a K-th of the cores
(`shares`): on 16 cores, five members' encoders step through 1 to 3 instances and threads each.

`measure` is any callable (settings, concurrency) -> Point: the session (session.py) serves and runs
perf_analyzer; the unit tests give it a synthetic response surface.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bionemo_export.choices import TuneObjective as Objective

from .space import AXES, Settings, around

Candidate = Mapping[str, Settings]
"""Settings of every tuned model, by model name."""


@dataclass(frozen=True)
class Point:
    """One perf_analyzer run: a candidate at one concurrency."""

    concurrency: int
    throughput: float
    """Sequences (inferences) per second."""
    p50_ms: float
    p99_ms: float
    server_batch: float | None = None
    """Rows the dynamic batcher handed the tuned model per execution."""

    def to_dict(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "throughput": self.throughput, "p50_ms": self.p50_ms,
                "p99_ms": self.p99_ms, "server_batch": self.server_batch}


@dataclass
class Trial:
    """A measured candidate."""

    candidate: Candidate
    points: list[Point] = field(default_factory=list)
    pruned: bool = False
    """Measured at fewer concurrencies: it fell behind at the first one."""
    seconds: float = 0.0
    role: str = "candidate"
    """baseline, candidate, or the confirmation runs: confirm-baseline, confirm-winner."""

    def point(self, concurrency: int) -> Point | None:
        return next((p for p in self.points if p.concurrency == concurrency), None)

    def feasible(self, max_p99_ms: float | None) -> bool:
        """Every measured concurrency within the latency bound (no bound: always)."""
        return max_p99_ms is None or all(p.p99_ms <= max_p99_ms for p in self.points)

    def score(self, objective: Objective) -> float:
        """Higher is better: the geometric mean of throughput, or of 1000 / p99 ms, over the
        concurrencies measured (a pruned trial is not comparable: 0)."""
        if self.pruned or not self.points:
            return 0.0
        values = [p.throughput if objective == Objective.THROUGHPUT else 1000.0 / max(p.p99_ms, 1e-6)
                  for p in self.points]
        return math.exp(sum(math.log(max(v, 1e-9)) for v in values) / len(values))

    def to_dict(self, objective: Objective, max_p99_ms: float | None) -> dict[str, Any]:
        return {"role": self.role, "settings": {m: s.values() for m, s in self.candidate.items()},
                "points": [p.to_dict() for p in self.points], "pruned": self.pruned,
                "feasible": self.feasible(max_p99_ms), "score": self.score(objective), "seconds": self.seconds}


@dataclass(frozen=True)
class SearchSettings:
    """How the search runs."""

    objective: Objective = Objective.THROUGHPUT
    concurrencies: tuple[int, ...] = (8, 32)
    max_p99_ms: float | None = None
    budget_s: float = 600.0
    min_gain: float = 0.03
    """A step must score this much better to be taken (the noise of a shared host)."""
    prune_below: float = 0.85
    """A candidate whose first point reaches less than this share of the best's is dropped there."""
    confirm: bool = True


@dataclass
class SearchResult:
    """Everything the search measured, the baseline and the winner (the baseline when nothing won)."""

    baseline: Trial
    winner: Trial
    trials: list[Trial]
    confirmation: tuple[Trial, Trial] | None = None
    """(baseline, winner) measured again side by side, when the winner differs from the baseline."""
    stopped_by: str = "converged"
    """converged (no step paid) or budget (time ran out)."""

    @property
    def changed(self) -> bool:
        return self.winner.candidate != self.baseline.candidate


class Progress:
    """Called as the search goes; the CLI shows it."""

    def trial_started(self, candidate: Candidate, role: str, index: int) -> None:
        pass

    def point_measured(self, point: Point) -> None:
        pass

    def trial_finished(self, trial: Trial, best: Trial) -> None:
        pass


Measure = Callable[[Candidate, int], Point]


class QuickSearch:
    """Hill climbing over every tuned model's settings (see the module docstring)."""

    def __init__(self, start: Candidate, measure: Measure, settings: SearchSettings, *, cores: int,
                 shares: Mapping[str, int] | None = None, progress: Progress | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.start, self.measure, self.settings, self.cores = dict(start), measure, settings, cores
        self.shares = dict(shares or {})
        """Models of a unit that run side by side (absent: 1); see the module docstring."""
        self.progress = progress or Progress()
        self.clock = clock
        self.began = clock()
        self.trials: list[Trial] = []
        self.seen: set[tuple] = set()

    # -- what order to measure, when to stop -------------------------------------------------------
    def order(self) -> list[int]:
        """Concurrencies, the most telling first: the highest for throughput, the lowest for latency."""
        ordered = sorted(set(self.settings.concurrencies))
        return ordered[::-1] if self.settings.objective == Objective.THROUGHPUT else ordered

    def cores_of(self, unit: str) -> int:
        """The cores each model of `unit` may count on: the host's, shared by the unit's models."""
        return max(1, self.cores // max(1, self.shares.get(unit, 1)))

    def time_left(self) -> float:
        return self.settings.budget_s - (self.clock() - self.began)

    def can_afford(self) -> bool:
        """Another full candidate fits the budget, keeping two for the confirmation."""
        done = [t.seconds for t in self.trials if not t.pruned] or [0.0]
        per_trial = sum(done) / len(done)
        reserve = 2 * per_trial if self.settings.confirm else 0.0
        return self.time_left() > per_trial + reserve

    # -- measuring ---------------------------------------------------------------------------------
    def evaluate(self, candidate: Candidate, best: Trial | None, role: str = "candidate") -> Trial:
        trial = Trial(dict(candidate), role=role)
        self.progress.trial_started(candidate, role, len(self.trials) + 1)
        started = self.clock()
        for concurrency in self.order():
            point = self.measure(candidate, concurrency)
            trial.points.append(point)
            self.progress.point_measured(point)
            if best is not None and self.falls_behind(point, best):
                trial.pruned = True
                break
        trial.seconds = self.clock() - started
        if role in ("baseline", "candidate"):
            self.trials.append(trial)
            self.seen.add(_key(candidate))
        return trial

    def falls_behind(self, point: Point, best: Trial) -> bool:
        """Prune: over the latency bound (when the best is within it: else every step towards it
        counts), or clearly behind the best at this concurrency."""
        bound = self.settings.max_p99_ms
        if bound is not None and point.p99_ms > bound and best.feasible(bound):
            return True
        reference = best.point(point.concurrency)
        if reference is None:
            return False
        if self.settings.objective == Objective.THROUGHPUT:
            return point.throughput < self.settings.prune_below * reference.throughput
        return point.p99_ms * self.settings.prune_below > reference.p99_ms

    def better(self, trial: Trial, best: Trial) -> bool:
        if trial.pruned:
            return False
        bound = self.settings.max_p99_ms
        if trial.feasible(bound) != best.feasible(bound):
            return trial.feasible(bound)
        return trial.score(self.settings.objective) > best.score(self.settings.objective) * (1 + self.settings.min_gain)

    # -- the climb ---------------------------------------------------------------------------------
    def run(self) -> SearchResult:
        baseline = best = self.evaluate(self.start, None, role="baseline")
        dimensions = [(model, axis) for axis in AXES for model, s in self.start.items() if getattr(s, axis) is not None]
        moved = True
        while moved:
            moved = False
            for model, axis in dimensions:
                climbed, best, out_of_time = self.climb(best, model, axis)
                moved = moved or climbed
                if out_of_time:
                    return self.finish(baseline, best, "budget")
        return self.finish(baseline, best, "converged")

    def climb(self, best: Trial, model: str, axis: str) -> tuple[bool, Trial, bool]:
        """Move along one axis while a value within the radius pays: (moved, the best trial, the
        budget ran out)."""
        climbed = False
        while True:
            nearby = [{**best.candidate, model: settings}
                      for settings in around(best.candidate[model], self.cores_of(model), axis)]
            nearby = [candidate for candidate in nearby if _key(candidate) not in self.seen]
            leader = best
            for candidate in nearby:
                if not self.can_afford():
                    return climbed or leader is not best, leader, True
                trial = self.evaluate(candidate, leader)
                self.progress.trial_finished(trial, leader)
                if self.better(trial, leader):
                    leader = trial
            if leader is best:
                return climbed, best, False
            best, climbed = leader, True

    def finish(self, baseline: Trial, best: Trial, stopped_by: str) -> SearchResult:
        result = SearchResult(baseline, best, self.trials, stopped_by=stopped_by)
        if best is baseline or not self.settings.confirm:
            return result
        # Measured again side by side, concurrency by concurrency, so that drift on a shared host
        # hits both alike; the winner stays only if it still wins.
        again = (Trial(dict(baseline.candidate), role="confirm-baseline"),
                 Trial(dict(best.candidate), role="confirm-winner"))
        for trial in again:
            self.progress.trial_started(trial.candidate, trial.role, len(self.trials) + 1)
        for concurrency in self.order():
            for trial in again:
                started = self.clock()
                point = self.measure(trial.candidate, concurrency)
                trial.points.append(point)
                trial.seconds += self.clock() - started
                self.progress.point_measured(point)
        result.confirmation = again
        bound = self.settings.max_p99_ms
        base, won = again
        if (won.feasible(bound), won.score(self.settings.objective)) < (base.feasible(bound),
                                                                        base.score(self.settings.objective)):
            result.winner = baseline
        return result


def _key(candidate: Candidate) -> tuple:
    return tuple(sorted((model, tuple(sorted(s.values().items()))) for model, s in candidate.items()))


def frontier(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (p99 ms, throughput) points no other point beats on both (lower latency and higher
    throughput), by latency: the throughput/latency frontier of the report's plot."""
    kept: list[tuple[float, float]] = []
    for latency, throughput in sorted(points, key=lambda p: (p[0], -p[1])):
        if not kept or throughput > kept[-1][1]:
            kept.append((latency, throughput))
    return kept
