"""Build a model repository from a checkpoint: load -> export -> verify -> plan -> write, atomically.

Everything a build writes lives in one folder it owns beside the destination, renamed into place
only when everything succeeded and removed however the build ends, SIGTERM, SIGINT and SIGHUP
included (build_staging.py). What the build verified and optimized is recorded in manifest.json
through typed records (build_records.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bionemo_export import __version__
from bionemo_export.build_precision import AUTO_INT8_MIN_SPEEDUP, PrecisionChoice, candidate_precisions
from bionemo_export.build_records import AccuracyRecord, GraphRecord, GraphVerification
from bionemo_export.build_staging import (
    BuildInterrupted,
    StagingError,
    remove_stale_builds,
    scratch_folder,
    signals_interrupt_the_build,
    staged_directory,
)
from bionemo_export.choices import AUTO_PRECISION, AutoPrecision, ChoiceError, Exporter, Precision, build_precision
from bionemo_export.errors import UserError, reason
from bionemo_export.exporters.graph_cache import GraphCache, default_graph_cache
from bionemo_export.exporters.optimize import PrecisionError
from bionemo_export.exporters.optimize.weight_only import BLOCK_SIZES, DEFAULT_BLOCK_SIZE
from bionemo_export.exporters.shared_weights import WEIGHTS_FILE, SharedWeightsWriter, describe
from bionemo_export.kits import ExportedGraph, PlanContext, graph_exports, kit_of, kits_of, needed_graphs
from bionemo_export.kits.masked_lm import masked_lm_head
from bionemo_export.memory_plan import (
    STREAMED,
    WEIGHT_ONLY_PRECISIONS,
    WEIGHTS_ON_DISK,
    BuildDisk,
    BuildMemory,
    build_disk,
    build_memory,
)
from bionemo_export.model_repository.backends import AUTO, BACKENDS, get_backend, resolve_auto
from bionemo_export.model_repository.consistency import check_repository
from bionemo_export.model_repository.hosted_graphs import host_graphs
from bionemo_export.model_repository.integrity import record_files
from bionemo_export.model_repository.manifest import (
    Manifest,
    checkpoint_digest,
    host_record,
    package_versions,
    source_sha256,
)
from bionemo_export.model_repository.member_ensemble import MemberGraphs, plan_member_ensemble
from bionemo_export.model_repository.options import ServingOptions
from bionemo_export.model_repository.plan import RepositoryPlan
from bionemo_export.models import LoadedModel, get_family, load_checkpoint
from bionemo_export.models.members import ENSEMBLE_TASKS, MemberFacts, MemberMismatch, check_member, member_label
from bionemo_export.models.readers.base import fp32_weight_bytes, widened_weight_bytes
from bionemo_export.models.readers.mapped import WIDEN_ON_DISK_BYTES, widening_deferred
from bionemo_export.procfs import available_memory_bytes
from bionemo_export.serving.host import NO_VNNI_FOLDER
from bionemo_export.serving.parameters import SOURCE_SHA256
from bionemo_export.tasks import HOSTED_FILES, HOSTED_GRAPHS, TASKS, Graph, Requirement, get_task

Progress = Callable[[str], None]
LOG = logging.getLogger(__name__)


class BuildError(UserError, RuntimeError):
    """The build cannot go on; the message says why and what to do."""


class PrecisionRefused(BuildError):
    """The encoder's graph in the precision asked for missed its accuracy gate (or, for `precision
    auto`, int8's speed floor); the message has the figures. `auto` tries its next precision."""


# BuildInterrupted and remove_stale_builds are build_staging's, named here too for a build's callers.
__all__ = ["BuildError", "BuildInterrupted", "BuildRequest", "BuildResult", "build_repository", "remove_stale_builds",
           "resolve_backend", "servable_tasks", "unserved_tasks"]


@dataclass(frozen=True)
class BuildRequest:
    family: str | None
    """Model family; None: the one a .nemo archive's `target` names."""
    checkpoint: Path
    name: str
    out: Path
    tasks: tuple[str, ...] | None = None
    """Public tasks to serve; None: every task the family serves by default (`Task.by_default`)."""
    exporter: Exporter = Exporter.TORCH
    backend: str = AUTO
    """A serving backend's name (model_repository/backends.py), or auto: `resolve_backend`."""
    max_length: int | None = None
    force: bool = False
    serving: ServingOptions = field(default_factory=ServingOptions)
    tritonserver: str | None = None
    """Server whose backends decide `--backend auto`."""
    max_decode_length: int | None = None
    """Decoding families: most tokens a decode produces (default: the model's limit)."""
    precision: Precision | AutoPrecision = Precision.FP32
    """The encoder graph's precision: fp32; int8 (dynamic quantization, CPU); int8w, int4 (weight-only,
    CPU: exporters/optimize/weight_only.py); fp16 (GPU hosts); auto: the fastest that meets its
    accuracy gate on this host (build_precision.py)."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """int8w, int4: weights per quantization block along the reduction axis (weight_only.BLOCK_SIZES)."""
    min_cosine: float | None = None
    """Reduced precisions: the least cosine against PyTorch fp32 every output of the encoder's graph
    must keep (with the margin above it), in place of the precision's own tolerance
    (verification.PRECISION_MIN_COSINE). Recorded in manifest.json and golden.npz: `verify` and
    the served model's load-time check hold the graph to it."""
    min_int8_speedup: float | None = None
    """int8: refuse the build (PrecisionRefused) when the int8 graph this host would serve runs at
    less than this many times the fp32 graph's speed on the build's check batch; None: kept at any
    speed (the log says when it is slower). `precision auto` sets it (build_precision.py)."""
    optimize: bool = True
    """Store the graphs optimized (exporters/optimize/); False: the plain export."""
    check_memory: bool = True
    """Refuse before loading a checkpoint this host's memory cannot build (check_build_memory)."""
    streamed: bool | None = None
    """int8w, int4: write the encoder's graph weight by weight from the checkpoint (exporters/streamed.py),
    for checkpoints whose fp32 weights do not fit in memory. None: when the memory check finds that
    the weights-on-disk build does not fit here (memory_plan.build_memory)."""
    graph_cache: Path | None = field(default_factory=default_graph_cache)
    """A folder of exported graphs to reuse and fill (exporters/graph_cache.py); by default the one
    $BIONEMO_EXPORT_GRAPH_CACHE names, else none."""
    members: tuple[Path, ...] = ()
    """Further checkpoints served with `checkpoint` as one ensemble (models/members.py: ESM-1v's
    seeds): N_logits answers the mean of the members' log-probabilities, N_scores the mean of their
    scores. Empty: `checkpoint` alone."""

    def __post_init__(self) -> None:
        """Check the settings and make each choice its enum, here where the request is made: the
        build and everything below it take the request's values as they are (a library caller may
        pass plain strings; `dataclasses.replace` checks again). The checkpoints and `out` are
        files, checked when a build starts (`_check_files`)."""
        try:
            object.__setattr__(self, "exporter", Exporter.parse(self.exporter, "exporter"))
            object.__setattr__(self, "precision", build_precision(self.precision))
        except ChoiceError as err:
            raise BuildError(str(err)) from None
        if self.backend != AUTO and self.backend not in BACKENDS:
            raise BuildError(f"`backend` {self.backend!r}: choose one of {AUTO}, {', '.join(BACKENDS)}")
        if not self.name.replace("_", "").replace("-", "").isalnum():
            raise BuildError(f"`name` {self.name!r}: use letters, digits, '_' or '-' (it prefixes model names)")
        if self.min_int8_speedup is not None and not self.min_int8_speedup > 0:
            raise BuildError(f"`min_int8_speedup` {self.min_int8_speedup}: a positive number of times the fp32 "
                             "graph's speed")
        if self.block_size not in BLOCK_SIZES:
            raise BuildError(f"`block_size` {self.block_size}: choose one of {', '.join(map(str, BLOCK_SIZES))} "
                             "(weights per quantization block of int8w and int4)")
        if self.min_cosine is not None and (self.precision == Precision.FP32 or not 0.0 < self.min_cosine < 1.0):
            raise BuildError(f"`min-cosine` {self.min_cosine}: a reduced precision's tolerance against fp32, between "
                             "0 and 1 (fp32 graphs are held to the family's own tolerance)"
                             if self.precision != Precision.FP32 else
                             "`min-cosine` sets a reduced precision's tolerance (int8, int8w, int4, fp16); fp32 graphs "
                             "are held to the family's own")
        if self.streamed:
            self._check_streamed()

    def _check_streamed(self) -> None:
        if self.precision == AUTO_PRECISION:
            raise BuildError("`stream-weights` writes int4 or int8w graphs; `precision` auto streams int8w by itself "
                             "where nothing else fits this host's memory: pass `precision` int4 or int8w, or leave "
                             "`stream-weights` unset")
        if self.precision not in WEIGHT_ONLY_PRECISIONS:
            raise BuildError(f"`stream-weights` writes {' or '.join(WEIGHT_ONLY_PRECISIONS)} graphs (weight-only "
                             "quantization as the weights stream); pass `precision` int4 or int8w, not "
                             f"{self.precision}")
        if self.members:
            raise BuildError("`stream-weights` builds one checkpoint; an ensemble's members are built in memory or "
                             "with their weights on disk")
        if self.exporter != Exporter.TORCH:
            raise BuildError("`stream-weights` exports with torch.onnx (`exporter` torch): Model Navigator writes "
                             "every weight of the graph at once")

    @property
    def checkpoints(self) -> tuple[Path, ...]:
        """Every checkpoint the build reads: `checkpoint`, then `members`."""
        return (self.checkpoint, *self.members)

    @property
    def graph_precision(self) -> Precision:
        """The precision of the graphs this request builds: `precision`, once `auto` has been
        resolved (`precision auto` builds one request per candidate precision)."""
        if not isinstance(self.precision, Precision):
            raise AssertionError("`precision` auto is resolved before a build (_build_choosing_precision)")
        return self.precision


@dataclass(frozen=True)
class BuildResult:
    repository: Path
    manifest: Manifest
    models: list[str]


def resolve_backend(backend: str, tritonserver: str | None = None) -> str:
    """`auto` -> the backend the target tritonserver can load that `auto` prefers (backends.py's
    `resolve_auto`: native when it has the onnxruntime backend, else python)."""
    if backend != AUTO:
        if backend not in BACKENDS:
            raise BuildError(f"`backend` {backend!r}: choose one of {AUTO}, {', '.join(BACKENDS)}")
        return backend
    from bionemo_export.runtime import TritonNotFoundError, find_tritonserver

    try:
        install = find_tritonserver(tritonserver)
    except TritonNotFoundError:
        return resolve_auto(None)
    return resolve_auto(install.can_load)


def _check_files(request: BuildRequest) -> None:
    """The request's files, when its build starts: `out` can be written, each checkpoint exists and
    is given once."""
    _check_out(request.out)
    if request.out.exists() and not request.force:
        raise BuildError(f"{request.out} already exists; pass `force` to replace it")
    seen: dict[Path, int] = {}
    for number, checkpoint in enumerate(request.checkpoints, 1):
        if not checkpoint.exists():
            raise BuildError(f"checkpoint not found: {checkpoint}")
        if checkpoint.resolve() in seen:
            raise BuildError(f"`checkpoint` {checkpoint} is given twice (members {seen[checkpoint.resolve()]} and "
                             f"{number}): an ensemble of one checkpoint twice weighs it twice; give each once")
        seen[checkpoint.resolve()] = number


def _check_out(out: Path) -> None:
    """`out` must be a folder (or not exist yet) whose nearest existing ancestor is a folder we
    can write in: checked before the (slow) checkpoint load."""
    if out.exists() and not out.is_dir():
        raise BuildError(f"`out` {out}: a file is there, not a repository folder")
    ancestor = out.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise BuildError(f"`out` {out}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise BuildError(f"`out` {out}: cannot write in {ancestor} (permission denied)")


def _check_tasks(family, tasks: tuple[str, ...] | None, hosts_graphs: bool = True) -> tuple[str, ...]:
    """The tasks to serve: those asked for, which the family must be able to serve
    (`ModelFamily.possible_tasks`), or all it can serve by default (a task entry's `by_default`;
    the checkpoint then serves those it carries: `servable_tasks`), less those whose graphs are the encoder again
    (tasks.HOSTED_GRAPHS) unless the encoder's model hosts them over its own weights
    (`hosts_graphs`: the Python backend, an fp32 encoder); elsewhere each would hold another copy
    of the weights (a quantized encoder's weights are other bytes than their fp32 ones)."""
    possible = family.possible_tasks()
    tasks = tasks or tuple(t for t in possible if get_task(t).by_default
                           and (hosts_graphs or not set(kit_of(t).graphs) & set(HOSTED_GRAPHS)))
    for task in tasks:
        try:
            get_task(task)
        except ValueError as err:  # a name the task table does not know: the message lists the known ones
            raise BuildError(str(err)) from None
    unsupported = [t for t in tasks if t not in possible]
    if unsupported:
        raise BuildError(f"family {family.name!r} serves {', '.join(possible)}; not {', '.join(unsupported)}")
    return tasks


def _sample_batches(loaded: LoadedModel) -> list[list[str]]:
    """Batches for the export check: all samples together (mixed lengths, padding), the shortest
    alone and the longest alone (different sequence lengths)."""
    samples = loaded.family.sample_sequences()
    by_length = sorted(samples, key=len)
    return [samples, [by_length[0]], [by_length[-1]]]


def _encode_batch(loaded: LoadedModel, sequences: list[str]) -> dict:
    # Cut to the tokenizer's limit: a build with a lower --max-length checks the graph on the samples' starts.
    encoded = loaded.tokenizer.encode(sequences, truncate=True)
    return {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask,
            "residue_mask": encoded.residue_mask}


@dataclass(frozen=True)
class GraphSource:
    """One graph to export: its name, the PyTorch module, its input and output specs, the batches
    that check the export against the module, and the input whose zeros mark padding there ("":
    outputs compared whole)."""

    name: str
    module: Any
    inputs: Any
    outputs: Any
    batches: list[dict]
    mask_input: str = "attention_mask"


@dataclass(frozen=True)
class GraphStorage:
    """How one graph is stored once its plain export verified: optimized or as exported, in which
    precision, written weight by weight or not, and the gates a reduced precision must pass. The
    encoder's graph takes the build's (`of_request`); the graphs that are the encoder again take
    its optimization only; the heads are stored as exported, in fp32 (the kits' `graphs`)."""

    optimize: bool = False
    precision: Precision = Precision.FP32
    streamed: bool = False
    """int8w, int4: written weight by weight from the checkpoint (exporters/streamed.py), checked once."""
    min_cosine: float | None = None
    """A reduced precision's tolerance asked for (BuildRequest.min_cosine)."""
    min_int8_speedup: float | None = None
    """BuildRequest.min_int8_speedup."""

    @classmethod
    def of_request(cls, request: BuildRequest, *, cpu_optimized: bool, streamed: bool = False) -> GraphStorage:
        """The encoder graph's storage in the build `request` asks for; optimized only where the
        backend runs ONNX Runtime on CPUs (`cpu_optimized`): TensorRT and GPU execution providers get
        the plain export, which they optimize for themselves (ONNX Runtime's CPU rewrites add
        operators TensorRT cannot parse)."""
        return cls(optimize=request.optimize and cpu_optimized, precision=request.graph_precision,
                   streamed=streamed, min_cosine=request.min_cosine, min_int8_speedup=request.min_int8_speedup)


@dataclass(frozen=True)
class GraphExportJob:
    """What every graph of one build is exported with: the build's folder, the exporter, the
    family (its tolerance), the model's heads and width (graph optimization), whether the served
    model picks its CPU's int8 graph, the graph cache, the weight-only block size, and where to say
    what it does. `export` runs one graph."""

    export_dir: Path
    exporter: Exporter
    family: Any
    progress: Progress
    num_heads: int | None = None
    hidden_size: int | None = None
    picks_cpu_graph: bool = True
    cache: GraphCache | None = None
    block_size: int = DEFAULT_BLOCK_SIZE

    @classmethod
    def of_request(cls, request: BuildRequest, loaded: LoadedModel, export_dir: Path, progress: Progress, *,
                   picks_cpu_graph: bool) -> GraphExportJob:
        """The job exporting `loaded`'s graphs for the build `request` asks for."""
        return cls(export_dir, request.exporter, loaded.family, progress, num_heads=loaded.description.get("heads"),
                   hidden_size=loaded.hidden_size, picks_cpu_graph=picks_cpu_graph,
                   cache=GraphCache(request.graph_cache) if request.graph_cache else None,
                   block_size=request.block_size)

    def export(self, source: GraphSource, storage: GraphStorage = GraphStorage()) -> ExportedGraph:
        """Export `source` to ONNX under export_dir/name, check it against PyTorch on its batches,
        then store it as `storage` says (optimized, in its precision) when that graph verifies too;
        raises ExportVerificationError when the plain export is over the family's tolerance. int8
        stores two graphs where `picks_cpu_graph` (the served model opens the one its CPU computes
        exactly: exporters/optimize/pipeline.verified_int8_graphs); every graph is stored with its
        golden answers."""
        from bionemo_export.exporters import NavigatorExportError, export_onnx, verify_onnx
        from bionemo_export.exporters.optimize import optimize_and_verify, verified_int8_graphs
        from bionemo_export.exporters.verification import ReferenceAnswers, write_golden_answers

        precision, optimize = storage.precision, storage.optimize
        if storage.streamed:
            return self._export_streamed(source, precision, storage.min_cosine)
        name, module, batches, mask_input = source.name, source.module, source.batches, source.mask_input
        inputs, outputs = source.inputs, source.outputs
        self.progress(f"exporting the {name} graph to ONNX ({self.exporter})")
        folder = self.export_dir / name
        folder.mkdir()
        workspace = self.export_dir / f"{name}.navigator" if self.exporter == Exporter.NAVIGATOR else None
        output_names = [t.name for t in outputs]
        answers = ReferenceAnswers(module, batches)  # PyTorch runs the batches once for every graph checked

        def export_and_check(graph_cache: GraphCache | None):
            try:
                exported = export_onnx(module, inputs, outputs, batches[0], folder / "model.onnx",
                                       exporter=self.exporter, workspace=workspace, cache=graph_cache)
            except NavigatorExportError as err:
                # Its logs are in the build's folder, which the build removes: quote their end.
                raise BuildError(f"{err}\n{_log_tail(workspace)}") from err
            self.progress(f"checking the {name} graph against PyTorch")
            return exported, verify_onnx(module, exported.path, batches, atol=self.family.atol,
                                         min_cosine=self.family.min_cosine, output_names=output_names,
                                         mask_input=mask_input, answers=answers)

        exported, report = export_and_check(self.cache)
        if not report.passed and exported.from_graph_cache and exported.graph_cache_key and self.cache is not None:
            LOG.warning("the %s graph from the graph cache %s failed its check against PyTorch; removed from the "
                        "cache and exported again", name, self.cache.root)
            self.cache.evict(exported.graph_cache_key)
            exported, report = export_and_check(self.cache)
        report.raise_for_tolerance()
        if optimize or precision != Precision.FP32:
            self.progress(f"optimizing the {name} graph ({precision}) and checking it against PyTorch")

        def log(message: str) -> None:
            LOG.warning(message)
            self.progress(message)

        settings: dict[str, Any] = dict(num_heads=self.num_heads, hidden_size=self.hidden_size,
                                        atol=self.family.atol, min_cosine=self.family.min_cosine,
                                        output_names=output_names, mask_input=mask_input, optimize=optimize,
                                        asked_min_cosine=storage.min_cosine, answers=answers)
        work = self.export_dir / f"{name}.optimized"
        no_vnni, speed = None, None
        if precision == Precision.INT8:
            int8 = verified_int8_graphs(module, exported.path, report, work, batches,
                                        one_graph=not self.picks_cpu_graph, log=log,
                                        min_speedup=storage.min_int8_speedup,
                                        **settings)
            chosen, no_vnni, speed = int8.main, int8.no_vnni, int8.speed
        else:  # fp32, fp16, and the weight-only int8w / int4 (block_size: theirs)
            chosen = optimize_and_verify(module, exported.path, report, work, batches, precision=precision, log=log,
                                         block_size=self.block_size, **settings)
        verification = GraphVerification(chosen.report, exported.path, chosen.record.precision,
                                         unoptimized=report if chosen.path != exported.path else None,
                                         no_vnni=no_vnni.report if no_vnni else None)
        files = {p.name: p for p in chosen.path.parent.iterdir() if p.is_file()}
        if no_vnni is not None:
            files.update({f"{NO_VNNI_FOLDER}/{p.name}": p for p in no_vnni.path.parent.iterdir() if p.is_file()})
        # What the served model checks on its host when it loads (serving/golden.py).
        golden = write_golden_answers(answers, chosen.report, self.export_dir / f"{name}.golden",
                                      mask_input=mask_input)
        files[golden.name] = golden
        # What is not stored gives its disk back before the next graph is exported (ESM-2 3B: 11 GB a
        # graph): the plain export when an optimized graph is stored (its file name is recorded), and
        # Model Navigator's workspace (its logs matter only when the export fails).
        if folder not in {chosen.path.parent, *([no_vnni.path.parent] if no_vnni else [])}:
            shutil.rmtree(folder)
        if workspace is not None:
            shutil.rmtree(workspace, ignore_errors=True)
        return ExportedGraph(name, files, GraphRecord(exported, chosen.record, no_vnni.record if no_vnni else None,
                                                      speed), verification)

    def _export_streamed(self, source: GraphSource, precision: Precision, min_cosine: float | None) -> ExportedGraph:
        """The graph written weight by weight in `precision` (exporters/streamed.py), checked against
        PyTorch in its served sessions with the precision's margin (pipeline.verify_streamed)."""
        from bionemo_export.exporters.optimize.pipeline import verify_streamed
        from bionemo_export.exporters.streamed import export_streamed
        from bionemo_export.exporters.verification import ReferenceAnswers, write_golden_answers

        name, module, batches, mask_input = source.name, source.module, source.batches, source.mask_input
        inputs, outputs = source.inputs, source.outputs
        self.progress(f"writing the {name} graph weight by weight ({precision}, streamed from the checkpoint)")
        folder = self.export_dir / name
        folder.mkdir()
        streamed = export_streamed(module, inputs, outputs, batches[0], folder / "model.onnx", precision=precision,
                                   block_size=self.block_size)
        self.progress(f"checking the {name} graph ({precision}) against PyTorch")
        answers = ReferenceAnswers(module, batches)
        chosen = verify_streamed(module, streamed.result, batches, atol=self.family.atol,
                                 min_cosine=self.family.min_cosine, output_names=[t.name for t in outputs],
                                 mask_input=mask_input, asked_min_cosine=min_cosine, answers=answers)
        verification = GraphVerification(chosen.report, streamed.export.path, chosen.record.precision)
        files = {p.name: p for p in folder.iterdir() if p.is_file()}
        golden = write_golden_answers(answers, chosen.report, self.export_dir / f"{name}.golden",
                                      mask_input=mask_input)
        files[golden.name] = golden
        return ExportedGraph(name, files, GraphRecord(streamed.export, chosen.record, None, None), verification)


def _check_streamed_tasks(tasks: tuple[str, ...]) -> None:
    """A streamed build writes the encoder's graph once: tasks whose graphs are the encoder again
    (layers, contacts, attentions: each another copy of the weights, in fp32) are refused."""
    again = [task for task in tasks if set(kit_of(task).graphs) & set(HOSTED_GRAPHS)]
    if again:
        raise BuildError(f"a streamed build (`stream-weights`) serves the encoder's graph and its heads; "
                         f"{', '.join(again)} need the encoder again in another graph, in fp32: leave them out of "
                         "`tasks`, or build them on a host whose memory holds the fp32 weights")


def _log_tail(workspace: Path | None, lines: int = 20) -> str:
    """The last lines of Model Navigator's logs in `workspace`, for an error message."""
    from bionemo_export.exporters.navigator import CONSOLE_LOG

    tails = []
    for log in (workspace / "navigator" / "navigator.log", workspace / CONSOLE_LOG) if workspace else ():
        try:
            text = log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
        except OSError:
            continue
        tails.append(f"last lines of {log.name} (removed with the build's folder):\n" + "\n".join(text))
    return "\n".join(tails) or "(Model Navigator wrote no log)"


def _other_tasks(loaded: LoadedModel) -> str:
    return ", ".join(loaded.servable()[:2])


MISSING: dict[Requirement, Callable[[LoadedModel, list[str]], str]] = {
    Requirement.ENCODER: lambda loaded, names: f"{loaded.checkpoint} has no encoder",
    Requirement.DECODER: (
        lambda loaded, names: f"{loaded.checkpoint} has no decoder: it cannot serve {', '.join(names)}; build "
                              f"{_other_tasks(loaded)} from it, or give an encoder-decoder checkpoint"),
    Requirement.LM_HEAD: (
        lambda loaded, names: f"{loaded.checkpoint} has no masked-LM head (it is not a *ForMaskedLM checkpoint): "
                              f"it cannot serve {', '.join(names)}; build {_other_tasks(loaded)} from it, or give a "
                              "checkpoint with the head"),
    Requirement.CLASSIFIER: (
        lambda loaded, names: f"{loaded.checkpoint} has no fine-tuned head (it is not a *ForSequenceClassification "
                              f"or *ForTokenClassification checkpoint): it cannot serve {', '.join(names)}; build "
                              f"{_other_tasks(loaded)} from it, or give a fine-tuned checkpoint"),
    Requirement.CONTACT_HEAD: (
        lambda loaded, names: f"{loaded.checkpoint} has no contact head (no contact_head.regression weights, "
                              f"which Hugging Face EsmModel and EsmForMaskedLM directories carry, and fair-esm files "
                              f"with their -contact-regression.pt beside them): it cannot serve {', '.join(names)}; "
                              "build "
                              f"{_other_tasks(loaded)} from it, or give a checkpoint with the head"),
    Requirement.ATTENTION_PROBABILITIES: (
        lambda loaded, names: f"{loaded.checkpoint} is read into the project's own transformer "
                              f"({loaded.description.get('architecture', 'its Megatron layout')}), whose fused "
                              f"attention answers no probabilities: it cannot serve {', '.join(names)}; build "
                              f"{_other_tasks(loaded)} from it, or give the model as a Hugging Face directory"),
    Requirement.ONE_CHARACTER_RESIDUES: (
        lambda loaded, names: f"{loaded.checkpoint}: {', '.join(names)} need one character per residue and a mask "
                              f"token; this model's alphabet is {', '.join(loaded.alphabet[:8])}...: build logits "
                              "instead"),
}
"""What a build asked for tasks whose requirements the checkpoint lacks says (LoadedModel.carries);
checked in this order, the first missing requirement naming the tasks that need it."""


def unserved_tasks(loaded: LoadedModel, tasks: tuple[str, ...]) -> dict[str, str]:
    """Those of `tasks` this checkpoint cannot serve, each with why (MISSING's message for the first
    requirement it lacks): what `inspect` reports."""
    why: dict[str, str] = {}
    for requirement, missing in MISSING.items():
        needing = [t for t in tasks if requirement in get_task(t).requires and t not in why]
        if needing and not loaded.carries(requirement):
            why.update({task: missing(loaded, needing) for task in needing})
    return {task: why[task] for task in tasks if task in why}


def servable_tasks(loaded: LoadedModel, tasks: tuple[str, ...], asked: bool) -> tuple[str, ...]:
    """`tasks` that this checkpoint can serve (each task entry's `requires`): asked for without
    what they require, they are an error naming the checkpoint; by default they are left out. A
    task brings along the tasks whose models it calls (its `calls`: N_scores calls N_logits)."""
    for requirement, missing in MISSING.items():
        needing = [t for t in tasks if requirement in get_task(t).requires]
        if needing and not loaded.carries(requirement):
            if asked:
                raise BuildError(missing(loaded, needing))
            tasks = tuple(t for t in tasks if t not in needing)
    for task in tasks:
        tasks += tuple(called for called in get_task(task).calls if called not in tasks)
    return tasks


def _export_all(loaded: LoadedModel, tasks: tuple[str, ...], job: GraphExportJob, encoder: GraphStorage,
                prefix: str = "", share_weights: bool = False) -> dict[str, ExportedGraph]:
    """Export, check and store every graph the tasks need with `job`: the encoder's as `encoder`
    says, those that are the encoder again with its optimization, the heads as exported.
    `prefix` starts the graphs' names (an ensemble member's: `m2_encoder`). `share_weights`: the
    graphs that are the encoder again (tasks.HOSTED_GRAPHS) are rewritten over one weights file
    with the encoder's (`_share_encoder_weights`), for a backend whose encoder model hosts them."""
    batches = [_encode_batch(loaded, batch) for batch in _sample_batches(loaded)]
    optimized = GraphStorage(optimize=encoder.optimize)
    needed = needed_graphs(tasks)
    sharing = share_weights and not prefix and bool(needed & set(HOSTED_GRAPHS))
    graphs = {}
    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(SharedWeightsWriter(job.export_dir / "shared")) if sharing else None
        for graph, how in graph_exports().items():  # in a fixed order: the manifest records them so
            if graph not in needed:
                continue
            module, inputs, outputs, graph_batches = how.source(loaded, batches)
            storage = encoder if how.encoder else optimized if how.optimized else GraphStorage()
            exported = job.export(GraphSource(prefix + graph.value, module, inputs, outputs, graph_batches,
                                              how.mask_input), storage)
            if writer is not None and (graph == Graph.ENCODER or graph in HOSTED_GRAPHS):
                exported = _share_graph(writer, exported)
            graphs[prefix + graph.value] = exported
    if writer is not None:
        job.progress(describe(writer.result))
    return graphs


def _share_graph(writer: SharedWeightsWriter, exported: ExportedGraph) -> ExportedGraph:
    """Rewrite the encoder's graph, or one that is the encoder again (tasks.HOSTED_GRAPHS: layers,
    contacts, attentions), over the repository's one weights file (exporters/shared_weights.py:
    each distinct tensor once), check that the rewritten graph answers its golden inputs as the
    exported one does (the rewrite moves bytes, nothing else), then delete the exported graph's
    own external data: the build's disk holds the shared file and one graph's data at a time.
    The returned graph's `files` name the rewritten graph (the encoder's, the weights file too)."""
    from bionemo_export.exporters.shared_weights import external_references
    from bionemo_export.serving.golden import GOLDEN_FILE, read_golden

    name = exported.name
    source = exported.files["model.onnx"]
    own_data = {ref.location for ref in external_references(source)}
    rewritten = writer.add(name, source, HOSTED_FILES.get(name, "model.onnx"))
    files = {key: path for key, path in exported.files.items() if key not in own_data}
    files["model.onnx"] = rewritten
    if name == "encoder":
        files[writer.result.weights.name] = writer.result.weights
    if GOLDEN_FILE in files:
        inputs = read_golden(str(files[GOLDEN_FILE])).inputs
        before, after = (_answers(path, inputs) for path in (source, rewritten))
        # (equal up to float noise: the same kernels over the same bytes, only their addresses differ)
        if not all(np.allclose(b, a, rtol=1e-5, atol=1e-6, equal_nan=True) for b, a in zip(before, after)):
            raise BuildError(f"the {name} graph rewritten over the shared {writer.result.weights.name} answers its "
                             "golden inputs otherwise than the exported graph: a bug in "
                             "exporters/shared_weights.py; build with `--backend native` meanwhile")
    for location in own_data:
        (source.parent / location).unlink(missing_ok=True)
    return dataclasses.replace(exported, files=files)


def _answers(graph: Path, inputs: dict) -> list:
    """Every output of `graph` on `inputs`, in one ONNX Runtime session of default options."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    names = [value.name for value in session.get_inputs()]
    return [np.asarray(value) for value in session.run(None, {name: inputs[name] for name in names})]


def estimate_build_memory(checkpoint: Path, precision: str = Precision.FP32, available: int | None = None,
                          streamed: bool | None = None) -> BuildMemory:
    """The memory a build of `checkpoint` in `precision` needs (memory_plan.build_memory: by the
    path it will take with `available` bytes free and `streamed` as asked), read from the
    checkpoint's headers before anything is loaded."""
    return build_memory(fp32_weight_bytes(Path(checkpoint)), precision, available, streamed)


def check_build_memory(checkpoint: Path, available: int | None, precision: str = Precision.FP32,
                       streamed: bool | None = None) -> BuildMemory:
    """The build's memory estimate (`estimate_build_memory`); BuildError before anything is loaded
    when it exceeds `available` bytes (None: unknown, not checked): an ESM C 6B in fp32 (25 GB of
    weights) would otherwise be killed by the kernel mid-build on a 24 GB host. An int8w or int4
    build that does not fit with its weights on disk is estimated streamed (memory_plan.STREAMED)."""
    estimate = estimate_build_memory(Path(checkpoint), precision, available, streamed)
    if available is not None and estimate.needed > available:
        advice = ("build it in fp32 here (its weights stay on disk) and quantize on a host with more memory"
                  if precision not in WEIGHT_ONLY_PRECISIONS and precision != Precision.FP32
                  and estimate.path == WEIGHTS_ON_DISK else
                  "build it in int4 (`precision` int4: its weights stream, quantized as they are written)"
                  if precision == Precision.FP32 and estimate.path == WEIGHTS_ON_DISK
                  and build_memory(estimate.weights, "int4", streamed=True).needed <= available else
                  "build on a host with more memory (the repository then serves anywhere the graph fits)")
        raise BuildError(f"{checkpoint}: building it in {precision} needs {estimate.text()}; "
                         f"{available / 2**30:.1f} GiB is available here. {advice[0].upper()}{advice[1:]}, or pass "
                         "--no-memory-check to try anyway")
    return estimate


def estimate_build_disk(checkpoint: Path, memory: BuildMemory, precision: str = Precision.FP32) -> BuildDisk:
    """The disk a build of `checkpoint` writes beside its output at its peak, by the path `memory`
    estimated (memory_plan.build_disk), with the fp32 copy of its half-precision weights (read from
    the safetensors headers) where the build widens them into a file. A streamed build widens its
    blocks' weights in memory while each is used (readers/mapped.widening_deferred): no such file."""
    widened = 0 if memory.path == STREAMED else widened_weight_bytes(Path(checkpoint))
    return build_disk(memory, precision, widened if widened > WIDEN_ON_DISK_BYTES else 0)


def check_build_disk(checkpoint: Path, out: Path, memory: BuildMemory, precision: str = Precision.FP32,
                     free: int | None = None) -> BuildDisk:
    """What the build writes beside `out` at its peak (memory_plan.build_disk, by the path `memory`
    estimated); BuildError before anything is loaded when the file system there has less free
    (`free`; None: asked of it): ESM-2 3B writes about 45 GB, and running out an hour into the
    build helps nobody."""
    estimate = estimate_build_disk(checkpoint, memory, precision)
    folder = out.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if free is None:
        free = shutil.disk_usage(folder).free
    if estimate.needed > free:
        raise BuildError(f"{checkpoint}: building it in {precision} writes {estimate.text()} beside {out}; "
                         f"{free / 2**30:.1f} GiB is free on {folder}'s file system. Free space there, build into "
                         "a folder on another file system (`out`), or pass --no-memory-check to try anyway")
    return estimate


def build_repository(request: BuildRequest, progress: Progress = lambda message: None) -> BuildResult:
    """Build the repository described by `request`; raises BuildError (or the exporter's
    verification error, or BuildInterrupted on SIGTERM, SIGINT or SIGHUP) and leaves nothing on
    disk when anything fails."""
    with signals_interrupt_the_build():
        _check_files(request)
        if request.precision == AUTO_PRECISION:
            return _build_choosing_precision(request, progress)
        return _build(request, progress)


def _build_choosing_precision(request: BuildRequest, progress: Progress) -> BuildResult:
    """`precision auto` (build_precision.py): a whole build in each precision `candidate_precisions`
    gives, in order, until one meets its gate (int8: and its speed floor); the plain exports are
    made once, through the request's graph cache or a temporary one beside `out`. Only the build
    kept is published; manifest.json's `precision_choice` records the tries."""
    from bionemo_export.serving.host import cpu_description

    try:
        backend = get_backend(resolve_backend(request.backend, request.tritonserver), request.serving.device)
    except ValueError as err:  # a device the backend cannot serve
        raise BuildError(str(err)) from err
    available = available_memory_bytes() if request.check_memory else None

    def fits(precision: str) -> bool:
        try:
            for path in request.checkpoints:
                check_build_memory(path, available, precision)
        except BuildError:
            return False
        return True

    choice = PrecisionChoice(candidate_precisions(cpu_kernels=backend.stores_cpu_optimized_graphs,
                                                  tensorrt=backend.name == "tensorrt", fits=fits),
                             host=cpu_description())
    progress(f"precision auto: trying {', '.join(choice.candidates.precisions)} ({choice.candidates.why})")
    with contextlib.ExitStack() as stack:
        cache = request.graph_cache
        if cache is None and len(choice.candidates.precisions) > 1:
            try:
                cache = stack.enter_context(scratch_folder(request.out, "graph-cache"))
            except StagingError as err:
                raise BuildError(str(err)) from err
        for number, precision in enumerate(choice.candidates.precisions, 1):
            last = number == len(choice.candidates.precisions)
            attempt = dataclasses.replace(
                request, precision=precision, graph_cache=cache,
                min_cosine=request.min_cosine if precision != Precision.FP32 else None,
                min_int8_speedup=(request.min_int8_speedup or AUTO_INT8_MIN_SPEEDUP) if precision == Precision.INT8
                else None)
            try:
                return _build(attempt, progress, choice)
            except PrecisionRefused as err:
                if last:
                    raise
                choice.refuse(precision, str(err))
                progress(f"precision auto: {precision} refused ({err}); trying "
                         f"{choice.candidates.precisions[number]}")
    raise AssertionError("unreachable: the last candidate returns or raises")


def _build(request: BuildRequest, progress: Progress, choice: PrecisionChoice | None = None) -> BuildResult:
    """One build in the precision `request` names; `choice`: `precision auto`'s record so far."""
    if request.family is not None:
        _check_tasks(get_family(request.family), request.tasks)
    backend = resolve_backend(request.backend, request.tritonserver)
    try:
        serving = dataclasses.replace(request.serving, backend=backend)
    except ValueError as err:  # a device or layout the backend cannot serve
        raise BuildError(str(err)) from err
    if request.graph_precision.quantized and not serving.serving_backend.stores_cpu_optimized_graphs:
        raise BuildError(f"`precision` {request.precision} is ONNX Runtime's CPU quantization; on `device` gpu use "
                         "fp16 (`backend` tensorrt builds fp16 engines by default)")

    if request.members:
        return _build_ensemble(request, backend, serving, progress, choice)
    memory = None
    if request.check_memory:
        memory = check_build_memory(request.checkpoint, available_memory_bytes(), request.precision,
                                    request.streamed)
        if memory is not None:
            progress(f"memory: this build needs {memory.text()}")
            disk = check_build_disk(Path(request.checkpoint), request.out, memory, request.precision)
            progress(f"disk: this build writes {disk.text()} beside {request.out}")
    streamed = request.streamed if request.streamed is not None else memory is not None and memory.path == STREAMED
    progress(f"loading {request.family or 'the'} checkpoint {request.checkpoint}")
    with widening_deferred(streamed):  # a streamed build reads each weight once: no fp32 copy on disk
        loaded = _load(request.checkpoint, request)
    # The hosted graphs share the encoder's weights when both are fp32 (they are exported in fp32:
    # a reduced-precision encoder's weights are other bytes), and the Python backend hosts them.
    hosts_graphs = serving.serving_backend.runs_python and request.precision == Precision.FP32
    tasks = servable_tasks(loaded, _check_tasks(loaded.family, request.tasks, hosts_graphs=hosts_graphs),
                           asked=request.tasks is not None)
    if streamed:
        _check_streamed_tasks(tasks)

    try:
        # Published at request.out when the block ends normally; removed however it ends.
        with staged_directory(request.out, force=request.force, log=progress) as stage:
            with stage.temporary_files() as temporary:
                export_dir = temporary / "onnx"
                export_dir.mkdir()
                try:
                    backend_class = serving.serving_backend
                    job = GraphExportJob.of_request(request, loaded, export_dir, progress,
                                                    picks_cpu_graph=backend_class.runs_python)
                    encoder = GraphStorage.of_request(request, cpu_optimized=backend_class.stores_cpu_optimized_graphs,
                                                      streamed=streamed)
                    graphs = _export_all(loaded, tasks, job, encoder, share_weights=backend_class.runs_python)
                except PrecisionError as err:
                    raise PrecisionRefused(str(err)) from err
                progress(f"writing the repository ({backend} backend)")
                plan = _plan(request, loaded, tasks, serving, graphs)
                checkpoint = _checkpoint_record(request.checkpoint, loaded)
                _stamp_source(plan, [checkpoint], request.precision)
                plan.write(stage.repository, link_from=temporary)
            manifest = _manifest(request, loaded, tasks, backend, serving, graphs, plan, stage.repository,
                                 checkpoint, choice=choice)
            findings = check_repository(stage.repository)
            if findings:  # a planner bug: what a server would refuse at load time, or fail on later
                raise BuildError("the written repository is inconsistent:\n  " + "\n  ".join(findings))
    except StagingError as err:  # no folder beside `out`, or `out` appeared during the build
        raise BuildError(str(err)) from err
    progress(f"built {request.out}")
    return BuildResult(request.out, manifest, [m.name for m in plan.models])


def _manifest(request: BuildRequest, loaded: LoadedModel, tasks: tuple[str, ...], backend: str,
              serving: ServingOptions, graphs: dict[str, ExportedGraph], plan: RepositoryPlan,
              staging: Path, checkpoint: dict[str, Any], members: list[dict[str, Any]] | None = None,
              choice: PrecisionChoice | None = None) -> Manifest:
    """Write manifest.json into `staging`, where the rest of the repository is written already.
    `checkpoint`: `_checkpoint_record`'s, the one the configs were stamped from (`_stamp_source`);
    `members`: an ensemble's checkpoint records, in order (`checkpoint` is then the first's);
    `choice`: `precision auto`'s record (its `precision_choice`)."""
    encoder = graphs["encoder"] if members is None else graphs[f"{member_label(1)}_encoder"]
    return Manifest(
        tool={"name": "bionemo-export", "version": __version__},
        name=request.name,
        family=loaded.family.name,
        tasks=list(tasks),
        public_models=[get_task(task).model(request.name) for task in tasks],
        models={m.name: m.description for m in plan.models},
        checkpoint=checkpoint,
        members=members,
        precision=request.precision,
        precision_choice=choice.to_dict(request.precision) if choice is not None else None,
        backend=backend,
        device=serving.serving_backend.device,
        exporter=request.exporter,
        export={name: graph.record.to_dict() for name, graph in graphs.items()},
        serving=dataclasses.asdict(serving),
        max_length=loaded.tokenizer.max_length,
        max_decode_length=request.max_decode_length or (loaded.seq2seq.max_decode_length
                                                        if loaded.seq2seq else None),
        verification={"passed": True,
                      "graphs": {name: graph.verification.to_dict() for name, graph in graphs.items()}},
        accuracy=AccuracyRecord(request.precision, encoder.verification, encoder.record.optimization).to_dict(),
        versions=package_versions(),
        build_host=host_record(),
        # Last, once every other file is written: serve and verify compare the files with these.
        files=record_files(staging),
    ).write(staging)


def _checkpoint_record(path: Path, loaded: LoadedModel) -> dict[str, Any]:
    """manifest.json's record of a checkpoint: its path, digest and the family's facts. Made once
    per checkpoint and build (the digest reads every byte of it), for the manifest and the configs'
    stamp alike."""
    return {"path": str(path.resolve()), "digest": checkpoint_digest(path), **loaded.description}


def _stamp_source(plan: RepositoryPlan, checkpoints: list[dict[str, Any]], precision: str) -> None:
    """Give every model of `plan` the SOURCE_SHA256 parameter (parameters.py): the digest of the
    `checkpoints` records' digests (`_checkpoint_record`, in member order) and `precision`, so that
    a repository rebuilt from another checkpoint under the same name serves other configs; a
    client reads configs, never manifest.json. The consistency check compares it with the manifest."""
    stamp = source_sha256([record["digest"] for record in checkpoints], precision)
    for model in plan.models:  # a new dict: planners may share one parameters dict between models
        model.parameters = {**model.parameters, SOURCE_SHA256: stamp}


def _load(path: Path, request: BuildRequest) -> LoadedModel:
    """The checkpoint at `path` loaded as the request asks; BuildError naming it when it cannot be."""
    try:
        return load_checkpoint(path, request.family, max_length=request.max_length)
    except Exception as err:  # a malformed checkpoint breaks readers and families in many ways: name it
        raise BuildError(f"cannot load {path}{f' as {request.family}' if request.family else ''}: "
                         f"{reason(err)}") from err


def _ensemble_tasks(request: BuildRequest, first: LoadedModel) -> tuple[str, ...]:
    """The tasks of an ensemble build: those asked (logits and scores only: ENSEMBLE_TASKS says
    why), else both where the members can serve them. Member 1 must carry the masked-LM head."""
    if request.tasks is not None:
        if others := [task for task in request.tasks if task not in ENSEMBLE_TASKS]:
            raise BuildError(f"`tasks` {', '.join(others)}: an ensemble of {len(request.checkpoints)} checkpoints "
                             f"serves {' and '.join(ENSEMBLE_TASKS)} only, computed from the mean of the members' "
                             "log-probabilities; the other tasks read one model's hidden states, which "
                             "independently trained members do not share (each has its own coordinates), so "
                             "their mean means nothing. Build those tasks from one checkpoint")
    possible = first.family.possible_tasks()
    tasks = _check_tasks(first.family, request.tasks or tuple(t for t in ENSEMBLE_TASKS if t in possible))
    servable_tasks(first, ("logits",), asked=True)  # the masked-LM head: what every member must have
    return servable_tasks(first, tasks, asked=request.tasks is not None)


def _build_ensemble(request: BuildRequest, backend: str, serving: ServingOptions, progress: Progress,
                    choice: PrecisionChoice | None = None) -> BuildResult:
    """A checkpoint ensemble (models/members.py, model_repository/member_ensemble.py). First every
    member is loaded in turn and checked against the first (a member that differs is refused in
    seconds, before any export); then each is loaded again, its graphs exported and checked
    against its own PyTorch model, and let go: one member in memory at a time, besides the first."""
    count = len(request.checkpoints)
    if request.check_memory:
        available = available_memory_bytes()
        for path in request.checkpoints:
            check_build_memory(path, available, request.precision)
    facts: list[MemberFacts] = []
    tasks: tuple[str, ...] = ()
    for number, path in enumerate(request.checkpoints, 1):
        progress(f"reading ensemble member {number} of {count}: {path}")
        loaded = _load(path, request)
        facts.append(MemberFacts.of(loaded))
        if number == 1:
            tasks = _ensemble_tasks(request, loaded)
            continue
        try:
            check_member(facts[0], facts[-1], number)
        except MemberMismatch as err:
            raise BuildError(str(err)) from None
    try:
        with staged_directory(request.out, force=request.force, log=progress) as stage:
            with stage.temporary_files() as temporary:
                export_dir = temporary / "onnx"
                export_dir.mkdir()
                first: LoadedModel | None = None
                records: list[dict[str, Any]] = []
                graphs: dict[str, ExportedGraph] = {}
                members: list[MemberGraphs] = []
                for number, path in enumerate(request.checkpoints, 1):
                    progress(f"loading ensemble member {number} of {count}: {path}")
                    loaded = _load(path, request)
                    if MemberFacts.of(loaded) != facts[number - 1]:  # the files changed since they were read
                        raise BuildError(f"ensemble member {number} ({path}) changed during the build; build again")
                    first = first or loaded
                    records.append({"member": member_label(number), **_checkpoint_record(path, loaded)})
                    label = member_label(number)
                    try:
                        job = GraphExportJob.of_request(request, loaded, export_dir, progress,
                                                        picks_cpu_graph=serving.serving_backend.runs_python)
                        encoder = GraphStorage.of_request(
                            request, cpu_optimized=serving.serving_backend.stores_cpu_optimized_graphs)
                        exported = _export_all(loaded, tasks, job, encoder, prefix=f"{label}_")
                    except PrecisionError as err:
                        raise PrecisionRefused(str(err)) from err
                    graphs.update(exported)
                    encoder = exported[f"{label}_encoder"]
                    members.append(MemberGraphs(
                        label, loaded.hidden_size, encoder.files, exported[f"{label}_lm_head"].files["model.onnx"],
                        encoder.record.optimization.serving_graph_optimization_level))
                assert first is not None  # request.checkpoints holds two at least
                if request.precision != Precision.FP32:  # each member's cost (manifest `accuracy`: member 1's)
                    for record in records:
                        member = graphs[f"{record['member']}_encoder"]
                        record["accuracy"] = AccuracyRecord(request.precision, member.verification,
                                                            member.record.optimization).to_dict()
                progress(f"writing the repository ({backend} backend): {count} members")
                plan = RepositoryPlan(plan_member_ensemble(
                    request.name, family=first.family.name, tokenizer=first.tokenizer, members=members,
                    head=masked_lm_head(first), tasks=tasks, options=serving))
                plan.validate()
                _stamp_source(plan, records, request.precision)
                plan.write(stage.repository, link_from=temporary)
            manifest = _manifest(request, first, tasks, backend, serving, graphs, plan, stage.repository,
                                 records[0], members=records, choice=choice)
            findings = check_repository(stage.repository)
            if findings:  # a planner bug: what a server would refuse at load time, or fail on later
                raise BuildError("the written repository is inconsistent:\n  " + "\n  ".join(findings))
    except StagingError as err:
        raise BuildError(str(err)) from err
    progress(f"built {request.out}: an ensemble of {count} members")
    return BuildResult(request.out, manifest, [m.name for m in plan.models])


def _plan(request: BuildRequest, loaded: LoadedModel, tasks: tuple[str, ...], serving: ServingOptions,
          graphs: dict[str, ExportedGraph]) -> RepositoryPlan:
    """The repository's plan: the base kit's (the encoder's, or for an encoder-decoder family the
    decoding kit's, which also plans the encoder's tasks), then the models each other kit of the
    tasks adds to it, in the table's order."""
    context = PlanContext(request.name, loaded, tasks, serving, graphs, request.max_decode_length)
    bases = [kit for kit in kits_of(TASKS) if kit.plans_base and kit.is_base(loaded)]
    if len(bases) != 1:
        raise BuildError(f"{loaded.checkpoint}: {len(bases)} kits plan the repository's base for it "
                         f"({', '.join(type(kit).__name__ for kit in bases) or 'none'}); exactly one must")
    plan = RepositoryPlan(bases[0].plan(context))
    plan.validate()
    for kit in kits_of(tasks):
        if not kit.plans_base:
            plan.models += kit.plan(context)
            plan.validate()
    weights = graphs["encoder"].files.get(WEIGHTS_FILE)
    if weights is not None:  # the graphs written over the encoder's weights file move into its model
        host_graphs(plan, f"{request.name}_encoder",
                    {graphs[name].files["model.onnx"]: name for name in HOSTED_FILES if name in graphs}, weights)
        plan.validate()
    return plan


