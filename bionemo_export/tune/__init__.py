"""`bionemo-export tune`: find the settings that serve a repository best on the host it runs on.

Triton users reach for Model Analyzer for this; it needs NVIDIA's container and knows nothing of
this tool's settings (ONNX Runtime threads, token budget, largest sub-batch, length bucket). The
tuner serves a working copy of the repository on the embedded tritonserver (session.py), climbs
through the settings of the models behind one public model with the real perf_analyzer
(search.py, space.py), writes the winner into the repository atomically with the settings it
replaced kept in manifest.json (apply.py, record.py), and reports every measurement (report.py).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bionemo_export.bench.inputs import InputSpec
from bionemo_export.errors import InvalidInputError
from bionemo_export.model_repository.manifest import Manifest
from bionemo_export.model_repository.pbtxt import to_pbtxt
from bionemo_export.serving.host import available_cores

from .apply import RestoreError, previous_configs, publish, restore
from .record import TUNING_KEY, host_mismatch, precision_mismatch, stamp, this_host
from .search import Objective, Point, Progress, QuickSearch, SearchResult, SearchSettings, Trial
from .session import TuneSession, tunable_models, tuned_units
from .space import Settings

__all__ = ["TUNING_KEY", "Objective", "Point", "Progress", "RestoreError", "SearchResult", "Settings", "Trial",
           "TuneOutcome", "TuneRequest", "default_model", "host_mismatch", "precision_mismatch", "restore",
           "tunable_models", "tune_repository", "tuned_units"]


@dataclass(frozen=True)
class TuneRequest:
    """What to tune and how long to try."""

    repository: Path
    model: str | None = None
    """The public model whose requests are measured (default: the embeddings model)."""
    objective: Objective = Objective.THROUGHPUT
    concurrencies: tuple[int, ...] = (8, 32)
    max_p99_ms: float | None = None
    inputs: InputSpec = field(default_factory=InputSpec)
    budget_minutes: float = 10.0
    window_s: float = 2.0
    """perf_analyzer's measurement window per run."""
    report_dir: Path | None = None
    """Default: `<repository>-tuning` beside the repository."""
    write: bool = True
    """False (--dry-run): report only."""
    tritonserver: str | None = None
    command: str = ""

    def __post_init__(self) -> None:
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise InvalidInputError("`concurrency` must be positive integers")
        if self.budget_minutes <= 0:
            raise InvalidInputError("`budget_minutes` must be more than 0")
        if self.max_p99_ms is not None and self.max_p99_ms <= 0:
            raise InvalidInputError("`max_p99_ms` must be more than 0")

    @property
    def out_dir(self) -> Path:
        return self.report_dir or self.repository.with_name(self.repository.name + "-tuning")


@dataclass
class TuneOutcome:
    result: SearchResult
    record: dict[str, Any]
    report: dict[str, Path]
    written: bool


def default_model(repository: Path) -> str:
    """The embeddings model of the repository's manifest, else its first public model."""
    public = Manifest.read(repository).public_models
    if not public:
        raise InvalidInputError(f"{repository}/manifest.json lists no public models: pass `model`")
    return next((m for m in public if m.endswith("_embeddings")), public[0])


def tune_repository(request: TuneRequest, progress: Progress | None = None) -> TuneOutcome:
    """Search, report, and (unless request.write is False) write the winner into the repository."""
    from .report import write_report  # matplotlib, only once there is something to draw

    repository = request.repository.resolve()
    manifest = Manifest.read(repository)  # the record of what was tuned lives there
    model = request.model or default_model(repository)
    out = request.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    settings = SearchSettings(objective=request.objective, concurrencies=tuple(request.concurrencies),
                              max_p99_ms=request.max_p99_ms, budget_s=request.budget_minutes * 60)
    with TuneSession(repository, model, out_dir=out, inputs=request.inputs, window_s=request.window_s,
                     tritonserver=request.tritonserver) as session:
        result = QuickSearch(session.baseline, session.measure, settings, cores=available_cores(),
                             shares=session.shares, progress=progress).run()
        configs = {name: to_pbtxt(config) for name, config in
                   session.changed_configs(result.winner.candidate, result.baseline.candidate).items()}
        inputs = session.live.data.description if session.live and session.live.data else ""
        together = {unit: list(models) for unit, models in session.units.items() if len(models) > 1}
    base, won = result.confirmation or (result.baseline, result.winner)
    record = {
        "tuned": stamp(), "host": this_host(), "model": model, "models": list(result.baseline.candidate),
        "tuned_together": together,
        "objective": str(request.objective), "concurrencies": list(request.concurrencies),
        "max_p99_ms": request.max_p99_ms, "inputs": inputs, "budget_s": settings.budget_s,
        "seconds": time.monotonic() - started, "candidates": len(result.trials), "stopped_by": result.stopped_by,
        "settings": {name: s.values() for name, s in result.winner.candidate.items()},
        "untuned_settings": {name: s.values() for name, s in result.baseline.candidate.items()},
        "figures": {"untuned": [p.to_dict() for p in base.points], "tuned": [p.to_dict() for p in won.points]},
        "report": str(out / "report.md"), "repository": str(repository), "command": request.command,
        "written": bool(configs) and request.write,
        "precision": manifest.precision, "precision_auto": manifest.precision_choice is not None,
        "precision_warning": precision_mismatch(manifest),
    }
    report = write_report(result, record, out)
    if configs and request.write:
        tuning = {key: record[key] for key in ("tuned", "host", "model", "objective", "concurrencies", "max_p99_ms",
                                               "inputs", "settings", "untuned_settings", "figures", "report")}
        if together:  # a unit's settings are every one of its models'
            tuning["tuned_together"] = together
        tuning["previous"] = previous_configs(repository, sorted(configs))
        if manifest.tuning:
            tuning["earlier"] = manifest.tuning
        publish(repository, configs, tuning)
    shutil.rmtree(out / "work", ignore_errors=True)
    return TuneOutcome(result, record, report, written=bool(configs) and request.write)
