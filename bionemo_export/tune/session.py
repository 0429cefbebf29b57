"""Serving candidates for the search: a working copy of the repository on the embedded tritonserver.

The user's repository is never touched while the search runs: its files are linked (or copied,
across file systems) into a working copy inside the report folder, whose tuned models' config.pbtxt
files are rewritten for each candidate and reloaded through Triton's repository API (the server
runs with explicit model control), and the public model is measured with the real perf_analyzer
(bench/run.py) on the repository's own generated inputs or the user's file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from bionemo_export.bench.inputs import InputSpec, generate_inputs
from bionemo_export.bench.run import BenchError, LiveTarget, Target, measure, open_target
from bionemo_export.model_repository.backends import runs_python
from bionemo_export.model_repository.manifest import Manifest
from bionemo_export.model_repository.pbtxt import ModelConfig, read_config, write_config
from bionemo_export.model_repository.reader import RepositoryModels
from bionemo_export.runtime import PerfAnalyzer, find_perf_analyzer
from bionemo_export.serving.parameters import BLS_MODELS

from .search import Candidate, Point
from .space import Settings, is_tunable, read_settings, write_settings


def working_copy(repository: Path, work: Path) -> Path:
    """`work` holding every file of `repository`: hard links where the file system allows (the
    graphs are large and never written), copies otherwise; config.pbtxt files are always copied,
    as the search rewrites them."""
    for directory, _, names in os.walk(repository):
        here = Path(directory)
        target = work / here.relative_to(repository)
        target.mkdir(parents=True, exist_ok=True)
        for name in names:
            if name.endswith(".pyc"):
                continue
            source = here / name
            if name != "config.pbtxt":
                with contextlib.suppress(OSError):
                    os.link(source, target / name)
                    continue
            shutil.copy2(source, target / name)
    return work


def tunable_models(repository: Path, model: str) -> list[str]:
    """The models the search tunes behind `model`: the dynamically batched models it runs
    (model_repository/reader.py: ensemble steps and BLS callees) that run a graph (their settings
    split the host's cores), BLS callers aside (their instances bound the work of long requests,
    not the host's speed)."""
    tuned = []
    for name in RepositoryModels.read(repository).runs(model):
        config = read_config(repository / name)
        parameters = dict(config.parameters)
        if is_tunable(config) and BLS_MODELS not in parameters and (
                "intra_op_threads" in parameters or not runs_python(config.backend)):
            tuned.append(name)
    return tuned


MEMBERS_UNIT = "{name}_m*_{role}"
"""The unit of a checkpoint ensemble's members' models of one role (`esm1v_m*_encoder`: every
member's N_m<i>_encoder), which the search sets alike."""


def tuned_units(repository: Path, model: str) -> dict[str, tuple[str, ...]]:
    """The models the search tunes behind `model` (`tunable_models`), as the units it sets: unit
    name -> its models. A checkpoint ensemble's members' models of one role (N_m1_encoder ...
    N_mK_encoder, from manifest.json's `members`) are one unit, `N_m*_encoder`, whose settings
    every member gets: Triton runs the members side by side on every request, which waits for
    the slowest, so a step that changed one member alone would hardly show, and K times the
    settings would cost the search K times its budget. Members whose settings differ now (edited
    by hand) stay units of their own, so that the baseline is the repository as it is. Every
    other model is a unit of its own."""
    models = tunable_models(repository, model)
    manifest = Manifest.read(repository)
    labels = [str(member.get("member")) for member in manifest.members or ()]
    units: dict[str, tuple[str, ...]] = {}
    for name in models:
        if any(name in unit for unit in units.values()):
            continue
        label = next((label for label in labels if name.startswith(f"{manifest.name}_{label}_")), None)
        if label is not None:
            role = name.removeprefix(f"{manifest.name}_{label}_")
            group = tuple(f"{manifest.name}_{other}_{role}" for other in labels)
            if all(member in models for member in group) and len(
                    {read_settings(read_config(repository / member)) for member in group}) == 1:
                units[MEMBERS_UNIT.format(name=manifest.name, role=role)] = group
                continue
        units[name] = (name,)
    return units


class TuneSession:
    """The working copy served, with `model` measured for each candidate (a context manager).
    A candidate sets units (`tuned_units`; `models`: those models, each a unit of its own): each
    of a unit's models gets the unit's settings."""

    def __init__(self, repository: Path, model: str, *, out_dir: Path, inputs: InputSpec, window_s: float,
                 models: list[str] | None = None, tritonserver: str | None = None,
                 perf_analyzer: PerfAnalyzer | None = None, max_trials: int = 6) -> None:
        self.repository, self.model, self.out_dir = repository, model, out_dir
        self.inputs, self.window_s, self.max_trials = inputs, window_s, max_trials
        self.requested_models, self.tritonserver = models, tritonserver
        self.perf_analyzer = perf_analyzer
        self.work = out_dir / "work"
        self.units: dict[str, tuple[str, ...]] = {}
        """Unit name -> the models it sets."""
        self.models: list[str] = []
        """Every tuned model, unit by unit."""
        self.configs: dict[str, ModelConfig] = {}
        self.current: dict[str, Settings] = {}
        """Each unit's settings as the working copy holds them."""
        self._stack = contextlib.ExitStack()
        self.live: LiveTarget | None = None

    def __enter__(self) -> TuneSession:
        try:
            return self._open()
        except BaseException:
            self._stack.close()
            raise

    def _open(self) -> TuneSession:
        if self.work.exists():
            shutil.rmtree(self.work)
        self._stack.callback(shutil.rmtree, self.work, True)
        working_copy(self.repository, self.work)
        self.pa = self.perf_analyzer or find_perf_analyzer()
        live = self._stack.enter_context(open_target(Target(self.model, repository=self.work, label="tune"),
                                                     tritonserver=self.tritonserver, log_dir=self.out_dir))
        spec = self.inputs if self.inputs.max_length is not None else replace(self.inputs, max_length=live.max_length)
        live.data = generate_inputs(live.inputs, spec)
        live.data_path = live.data.write(self.out_dir / "input_data.json")
        self.live = live
        self.units = ({name: (name,) for name in self.requested_models} if self.requested_models
                      else tuned_units(self.work, self.model))
        self.models = [name for models in self.units.values() for name in models]
        if not self.models:
            raise BenchError(f"{self.model} runs no dynamically batched model with settings to tune")
        self.configs = {name: read_config(self.work / name) for name in self.models}
        self.current = dict(self.baseline)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    @property
    def baseline(self) -> Candidate:
        """Each unit's settings as the repository has them (a unit's models have the same)."""
        return {unit: read_settings(self.configs[models[0]]) for unit, models in self.units.items()}

    @property
    def shares(self) -> dict[str, int]:
        """How many models of each unit run side by side (QuickSearch's `shares`)."""
        return {unit: len(models) for unit, models in self.units.items()}

    def config_for(self, name: str, settings: Settings) -> ModelConfig:
        """The model's config.pbtxt with `settings` (everything else as the repository has it)."""
        return write_settings(self.configs[name], settings)

    def changed_configs(self, candidate: Candidate, baseline: Candidate) -> dict[str, ModelConfig]:
        """The config of every model whose unit `candidate` sets otherwise than `baseline`, by model."""
        return {name: self.config_for(name, settings) for unit, settings in candidate.items()
                if settings != baseline[unit] for name in self.units[unit]}

    def apply(self, candidate: Candidate) -> None:
        """Serve `candidate`: rewrite the changed units' models' configs and reload them."""
        assert self.live is not None
        for unit, settings in candidate.items():
            if self.current.get(unit) == settings:
                continue
            for name in self.units[unit]:
                write_config(self.work / name, self.config_for(name, settings))
                try:
                    self.live.client.load_model(name)
                except Exception as err:  # tritonclient's own exception types
                    raise BenchError(f"{name} did not load with {settings.describe()}: {err}; see the server log "
                                     f"in {self.out_dir}") from err
            self.current[unit] = settings
        if not self.live.client.model_ready(self.model):
            self.live.client.load_model(self.model)

    def measure(self, candidate: Candidate, concurrency: int) -> Point:
        """perf_analyzer on the public model, serving `candidate`, at `concurrency`."""
        assert self.live is not None
        self.apply(candidate)
        result = measure(self.pa, self.live, concurrency, window_s=self.window_s, out_dir=self.out_dir,
                         stability_percentage=15.0, max_trials=self.max_trials)
        batch = next((m.batch_size for m in result.models if m.name == self.models[0] and m.executions), None)
        return Point(concurrency, result.sequences_per_s, result.p50_ms, result.p99_ms, batch)
