"""What a build stores for one graph: candidate graphs made in order, each checked against PyTorch,
the first that passes kept.

    chosen = optimize_and_verify(module, plain, plain_report, work, batches, num_heads=8,
                                 hidden_size=512, atol=1e-4, min_cosine=0.9999,
                                 output_names=["hiddens", "embeddings"], mask_input="attention_mask")
    chosen.path, chosen.report, chosen.record.to_dict()   # the graph, its check, manifest.json's entry

Candidates come from `optimize_onnx` (candidates.py) with the options of ATTEMPTS, in order; each is
checked with the precision's tolerance (exporters/verification.py). For fp32 the plain export is
kept, with the reason logged and recorded, when no optimized graph verifies. For int8 the
candidates keep a growing share of the feed-forward output MatMuls (the most sensitive to int8,
ranked by their simulated int8 error on the build's sample batch) in fp32; int8w keeps them in
fp32 and int4 at 8 bits (weight_only.py); when none passes, the build fails with the figures
rather than silently shipping another precision.

A quantized graph (int8, int8w, int4) is checked as its served model opens it: at the serving
level the build records, with one intra-op thread and with every core of the build host (a served
instance runs between the two: serving/host.threads_per_instance), its figures the worst of those
sessions. It is accepted only with a margin: each output's min cosine must leave MARGIN_SHARE of
the tolerance's room (1 - min cosine) unused, so that the same graph in another session or on
another CPU, which the served golden check holds to the tolerance itself, still passes there.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bionemo_export.choices import Precision
from bionemo_export.errors import UserError
from bionemo_export.serving.parameters import UNOPTIMIZED_SERVING_LEVEL

from .candidates import DEFAULT_LEVEL, FusedGraph, OptimizationError, OptimizationResult, fuse_graph, optimize_onnx
from .weight_only import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE

if TYPE_CHECKING:
    import onnxruntime as ort

    from bionemo_export.exporters.verification import ReferenceAnswers, Tolerance, VerificationReport

LOG = logging.getLogger(__name__)

MARGIN_SHARE = 0.1
"""The share of a quantized graph's tolerance room (1 - min cosine) that its build check must
leave unused: embeddings 0.9991 for int8's 0.999, 0.99955 for int8w's 0.9995, 0.973 for int4's
0.97. Sized from the spread measured on the real AntiBERTy (docs/building.md, "Margin"): none
between intra-op thread counts (1-4 threads: the same figures to 7 digits, every precision), ~1.5%
of the room between CPU kinds (int8 u8u8, AVX-512 vs AVX2); the optimization level, which moved
int8 by a third of its room (the 0.999075 built, 0.998762 served case), is the served one here."""


def margin_min_cosine(min_cosine: float) -> float:
    """The min cosine a quantized graph must reach at build time for a tolerance of `min_cosine`."""
    return 1.0 - (1.0 - min_cosine) * (1.0 - MARGIN_SHARE)


def served_sessions(level: str) -> dict[str, ort.SessionOptions]:
    """The sessions a quantized graph is checked in at build time: as its served model opens it
    (`level`, the serving graph optimization level; runtime_session.served_session_options), with
    one intra-op thread and with every core here, labelled for manifest.json."""
    from bionemo_export.exporters.runtime_session import served_session_options
    from bionemo_export.serving.host import available_cores

    counts = sorted({1, available_cores()})
    return {f"{level}, {count} thread{'s' if count > 1 else ''}": served_session_options(level, count)
            for count in counts}


class PrecisionError(UserError, RuntimeError):
    """No reduced-precision graph met its tolerance; the message has the figures."""


@dataclass(frozen=True)
class CandidateFigures:
    """How one output of a rejected candidate compared with PyTorch."""

    max_abs_error: float
    min_cosine: float
    required_min_cosine: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RejectedCandidate:
    """A candidate graph that was tried and not kept: it was not produced or does not run
    (`error`), or it ran outside tolerance (`applied`, `figures`)."""

    options: dict[str, Any]
    """The optimize_onnx options it was made with (the calibration batch left out)."""
    error: str | None = None
    applied: tuple[str, ...] = ()
    figures: dict[str, CandidateFigures] = field(default_factory=dict)
    """Output name -> its figures, when it ran."""

    def to_dict(self) -> dict[str, Any]:
        if self.error is not None:
            return {"options": self.options, "error": self.error}
        return {"options": self.options, "applied": list(self.applied),
                "figures": {name: figures.to_dict() for name, figures in self.figures.items()}}

    def text(self) -> str:
        """One clause for a log line or an error message."""
        what = _options_text(self.options)
        if self.error is not None:
            return f"{what}: {self.error}"
        return f"{what}: " + ", ".join(f"{name} min cosine {f.min_cosine:.6f}, max abs error {f.max_abs_error:.3g}"
                                       for name, f in self.figures.items())


@dataclass(frozen=True)
class OptimizationRecord:
    """manifest.json's `optimization` entry for one graph: the optimized graph kept (`result`), or
    the plain export and why (`fallback`), with the candidates rejected on the way."""

    result: OptimizationResult | None
    """The candidate kept; None: the plain export was kept."""
    fallback: str | None = None
    """Why the plain export was kept; None when an optimized graph was."""
    rejected: tuple[RejectedCandidate, ...] | None = None
    """The candidates tried and not kept, in order; None when none was tried (optimization not asked)."""

    @property
    def precision(self) -> Precision:
        return self.result.precision if self.result is not None else Precision.FP32

    @property
    def serving_graph_optimization_level(self) -> str:
        """The ONNX Runtime session level the stored graph is to be opened at."""
        return self.result.serving_graph_optimization_level if self.result is not None else UNOPTIMIZED_SERVING_LEVEL

    def to_dict(self) -> dict[str, Any]:
        rejected = [candidate.to_dict() for candidate in self.rejected or ()]
        if self.result is not None:
            return {**self.result.to_dict(), "fallback": None, "rejected": rejected}
        record: dict[str, Any] = {"precision": "fp32", "applied": [], "fused": {}, "level": "none",
                                  "serving_graph_optimization_level": UNOPTIMIZED_SERVING_LEVEL,
                                  "fallback": self.fallback}
        if self.rejected is not None:
            record["rejected"] = rejected
        return record


@dataclass(frozen=True)
class VerifiedGraph:
    """The graph a build stores for one model, and how it got there."""

    path: Path
    """The optimized graph, or the plain export when optimization failed or was not asked."""
    report: VerificationReport
    """Its check against PyTorch (fp32)."""
    record: OptimizationRecord
    """manifest.json's `optimization` entry: precision, steps applied, fused operators, the
    serving level, and `fallback` (why the plain export was kept) or None."""


ATTEMPTS: dict[Precision, tuple[dict[str, Any], ...]] = {
    Precision.FP32: ({},),
    # int8: everything, then a growing share of the feed-forward output MatMuls in fp32 (the most
    # sensitive: AntiBERTy's embeddings went from min cosine 0.9987 to 0.9990 / 0.9992 / 0.9995 with
    # 1/4, 1/2, all of them kept), then without the fusions in case they are what disagrees.
    Precision.INT8: ({}, {"keep_fp32": 0.25}, {"keep_fp32": 0.5}, {"keep_fp32": 1.0},
                     {"fuse": False, "keep_fp32": 1.0}),
    # Weight-only (weight_only.py): every MatMul, then the feed-forward outputs kept at more bits
    # (int8w: fp32; int4: 8 bits), then without the fusions.
    Precision.INT8W: ({}, {"keep_fp32": 1.0}, {"fuse": False, "keep_fp32": 1.0}),
    Precision.INT4: ({}, {"keep_int8": 0.5}, {"keep_int8": 1.0}, {"fuse": False, "keep_int8": 1.0}),
    Precision.FP16: ({}, {"fuse": False}),
}
"""The optimize_onnx options tried in order for each precision; the first that verifies is kept."""


class FusedGraphs:
    """`fuse_graph` of one plain export, made once per `fuse` setting and shared by the candidates of
    the int8 ladders (both weights' types) and the fp32 graph they are timed against: the fusions and
    the int8 error ranking are the same for all of them. AntiBERTy's int8 build (six candidates and
    the fp32 graph): 42.5 s before, 38.0 s after, the same files (Zen 4, under cProfile). A graph with
    external data is fused again for each candidate instead of being kept in memory."""

    def __init__(self, plain: Path, num_heads: int | None, hidden_size: int | None) -> None:
        self.plain, self.num_heads, self.hidden_size = plain, num_heads, hidden_size
        self._graphs: dict[bool, FusedGraph] = {}

    def get(self, fuse: bool) -> FusedGraph:
        """The fused graph for `fuse` (OptimizationError as fuse_graph raises it)."""
        graph = self._graphs.get(fuse)
        if graph is None:
            graph = fuse_graph(self.plain, num_heads=self.num_heads, hidden_size=self.hidden_size, fuse=fuse)
            if not graph.external:
                self._graphs[fuse] = graph
        return graph


def optimize_and_verify(
    module: Any,
    plain: Path,
    plain_report: VerificationReport,
    work: Path,
    batches: Sequence[Any],
    *,
    num_heads: int | None,
    hidden_size: int | None,
    atol: float,
    min_cosine: float,
    output_names: Sequence[str],
    mask_input: str,
    precision: Precision | str = Precision.FP32,
    optimize: bool = True,
    int8_weights: str = "int8",
    log: Callable[[str], None] | None = None,
    fused_graphs: FusedGraphs | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
    asked_min_cosine: float | None = None,
    answers: ReferenceAnswers | None = None,
) -> VerifiedGraph:
    """Optimize the verified plain export `plain` (and convert it to `precision`), check each
    candidate against `module` on `batches` with the precision's tolerance (fp32: the family's
    `atol`/`min_cosine`), and return the first that passes.

    fp32: when nothing passes (or optimize is False) the plain export is kept, with the reason
    logged and recorded. Other precisions: raises PrecisionError when no candidate meets the
    tolerance (quantized ones: with its margin, checked in their served sessions; the module's docstring).
    `int8_weights` (int8): "int8" or "uint8" weights (quantization.py: which CPUs compute them exactly).
    `fused_graphs` (int8): the fused graphs the candidates start from, shared with other ladders of
    `plain`; None makes them here. `block_size`, `accuracy_level` (int8w, int4): weight_only.py's.
    `asked_min_cosine`: a reduced precision's tolerance for every output, in place of its own
    (verification.precision_tolerances); the margin applies to it as to the precision's.
    `answers`: the module's outputs on `batches` from the plain export's check (verification.py's
    ReferenceAnswers): every candidate is compared with them; None runs the module for each.
    """
    from bionemo_export.exporters.verification import precision_tolerances, verify_onnx

    log = log or LOG.warning
    precision = Precision.parse(precision, "precision")
    tolerances = precision_tolerances(precision, output_names, atol, min_cosine, asked_min_cosine)
    quantized = precision.quantized
    required = {name: margin_min_cosine(t.min_cosine) if quantized else t.min_cosine for name, t in tolerances.items()}
    if precision == Precision.FP32 and not optimize:
        return VerifiedGraph(plain, plain_report, OptimizationRecord(None, fallback="not asked (--no-optimize)"))
    failures: list[RejectedCandidate] = []
    for index, options in enumerate(ATTEMPTS[precision]):
        options = dict(options)
        if not optimize:  # quantized graphs are CPU graphs: the offline optimization is part of them
            options.update(fuse=False, level=DEFAULT_LEVEL if quantized else "none")
        destination = Path(work) / f"{precision}-{index}" / plain.name
        if precision == Precision.INT8:
            if int8_weights != "int8":
                options["int8_weights"] = int8_weights
            options.setdefault("calibration", {name: np.asarray(value) for name, value in batches[0].items()})
        try:
            if precision == Precision.INT8:
                fused_graphs = fused_graphs or FusedGraphs(plain, num_heads, hidden_size)
                options["fused"] = fused_graphs.get(options.get("fuse", True))
            if precision in (Precision.INT8W, Precision.INT4):
                options.update(block_size=block_size, accuracy_level=accuracy_level)
            result = optimize_onnx(plain, destination, num_heads=num_heads, hidden_size=hidden_size,
                                   precision=precision, **options)
        except OptimizationError as err:
            failures.append(RejectedCandidate(_options_record(options), error=str(err)))
            log(f"{plain.parent.name}: {precision} optimization {_options_text(options)} failed: {err}")
            _discard(destination)
            continue
        try:
            checked = _as_vnni_hosts_compute(result.path) if precision == Precision.INT8 and int8_weights == "int8" \
                else result.path
            report = verify_onnx(module, checked, batches, atol=atol, min_cosine=min_cosine,
                                 output_names=output_names, mask_input=mask_input,
                                 tolerances=tolerances if precision != Precision.FP32 else None,
                                 sessions=served_sessions(result.serving_graph_optimization_level)
                                 if quantized else None, answers=answers)
            report = dataclasses.replace(report, onnx_path=result.path)
        except Exception as err:  # ONNX Runtime refusing to run the rewritten graph
            failures.append(RejectedCandidate(_options_record(options), error=f"{type(err).__name__}: {err}"))
            log(f"{plain.parent.name}: the {precision} graph {_options_text(options)} does not run: {err}")
            _discard(destination)
            continue
        if _accepted(report, required):
            return VerifiedGraph(result.path, report, OptimizationRecord(result, rejected=tuple(failures)))
        figures = _figures(report, required)
        failures.append(RejectedCandidate(_options_record(options), applied=result.applied, figures=figures))
        _discard(destination)
        below = "below its margin" if report.passed else "outside tolerance"
        log(f"{plain.parent.name}: the {precision} graph {_options_text(options)} is {below}: "
            + "; ".join(f"{name} min cosine {f.min_cosine:.6f} (required {_required_text(tolerances[name], f)}), "
                        f"max abs error {f.max_abs_error:.3g}" for name, f in figures.items()))
    if precision == Precision.FP32:
        reason = "the optimized graph " + ("; ".join(failure.text() for failure in failures) or "was not produced")
        log(f"{plain.parent.name}: keeping the unoptimized graph: {reason}")
        return VerifiedGraph(plain, plain_report, OptimizationRecord(None, fallback=reason, rejected=tuple(failures)))
    raise PrecisionError(
        f"no {precision} graph of {plain.parent.name} meets the {precision} tolerance against PyTorch fp32"
        + (" with its margin" if quantized else "") + " ("
        + ", ".join(f"{name} min cosine {required[name]:.6g}" for name in tolerances) + "): "
        + "; ".join(failure.text() for failure in failures)
        + f". {_instead(precision)}")


def verify_streamed(module: Any, result: OptimizationResult, batches: Sequence[Any], *, atol: float,
                    min_cosine: float, output_names: Sequence[str], mask_input: str,
                    asked_min_cosine: float | None = None, answers: ReferenceAnswers | None = None) -> VerifiedGraph:
    """A streamed graph (exporters/streamed.py: quantized once, no candidates) checked against
    `module` as the ladder checks a quantized candidate: in its served sessions, with the
    precision's tolerance (or `asked_min_cosine`) and its margin; PrecisionError with the figures
    when it falls short."""
    from bionemo_export.exporters.verification import precision_tolerances, verify_onnx

    tolerances = precision_tolerances(result.precision, output_names, atol, min_cosine, asked_min_cosine)
    required = {name: margin_min_cosine(t.min_cosine) for name, t in tolerances.items()}
    report = verify_onnx(module, result.path, batches, atol=atol, min_cosine=min_cosine, output_names=output_names,
                         mask_input=mask_input, tolerances=tolerances,
                         sessions=served_sessions(result.serving_graph_optimization_level), answers=answers)
    if _accepted(report, required):
        return VerifiedGraph(result.path, report, OptimizationRecord(result, rejected=()))
    figures = _figures(report, required)
    raise PrecisionError(
        f"the streamed {result.precision} graph of {result.path.parent.name} is "
        + ("below its margin" if report.passed else "outside tolerance") + " against PyTorch fp32: "
        + "; ".join(f"{name} min cosine {f.min_cosine:.6f} (required {_required_text(tolerances[name], f)}), max abs "
                    f"error {f.max_abs_error:.3g}" for name, f in figures.items())
        + f". A streamed graph is quantized once, every product alike. {_instead(result.precision)}")


def _discard(candidate: Path) -> None:
    """Remove a rejected candidate's folder (its graph and weights: the next candidate's disk)."""
    shutil.rmtree(candidate.parent, ignore_errors=True)


def _accepted(report: VerificationReport, required: dict[str, float]) -> bool:
    """Within tolerance, and each output's min cosine at least its `required` (the margin)."""
    return report.passed and all(check.min_cosine >= required[check.name] for check in report.outputs)


def _figures(report: VerificationReport, required: dict[str, float]) -> dict[str, CandidateFigures]:
    return {check.name: CandidateFigures(check.max_abs_error, check.min_cosine, required[check.name])
            for check in report.outputs}


def _required_text(tolerance: Tolerance, figures: CandidateFigures) -> str:
    if figures.required_min_cosine == tolerance.min_cosine:
        return f"{tolerance.min_cosine:g}"
    return f"{figures.required_min_cosine:.6g}: the tolerance {tolerance.min_cosine:g} and a margin"


def _instead(precision: Precision) -> str:
    """What a build whose `precision` found no graph tells the user to pass instead."""
    if precision == Precision.INT4:  # a smaller block moved AntiBERTy's int4 little (0.973 at 32, 0.977 at 16)
        return "Build with `precision` int8w (8-bit weights: about twice int4's bytes)."
    if precision == Precision.INT8:
        return "Build with `precision` int8w (weight-only: closer to fp32), fp32 or fp16."
    return "Build with `precision` fp32."


def _as_vnni_hosts_compute(graph: Path) -> Path:
    """The file whose check stands for the int8-weight (u8s8) `graph` on the hosts that open it
    (VNNI/AMX: exact integer sums). On such a host, `graph` itself. On a host without VNNI, whose
    kernels saturate u8 x s8 products, its exact u8u8 twin (quantization.write_exact_twin): the
    integers VNNI hosts sum, so the check is not spoiled by saturation (the fp32 parts still round
    as this host's kernels do: docs/building.md)."""
    from bionemo_export.serving.host import cpu_description

    from .quantization import write_exact_twin

    if cpu_description()["vnni"]:
        return graph
    twin = graph.parent / "exact-twin" / graph.name
    return twin if write_exact_twin(graph, twin) else graph


def _options_record(options: dict[str, Any]) -> dict[str, Any]:
    """A candidate's options as manifest.json and the log name them: its own, less what every
    candidate shares (the calibration batch, the fused graph, weight-only's block size and level,
    which the quantization record holds)."""
    return {key: value for key, value in options.items()
            if key not in ("calibration", "fused", "block_size", "accuracy_level")}


def _options_text(options: dict[str, Any]) -> str:
    record = _options_record(options)
    return f"with {record}" if record else "with all steps"


@dataclass(frozen=True)
class Int8Graphs:
    """What an int8 build stores for one graph, and what int8 is worth on the build host."""

    main: VerifiedGraph
    """model.onnx: the u8s8 graph (VNNI/AMX hosts), or the u8u8 one where it is stored alone."""
    no_vnni: VerifiedGraph | None
    """no-vnni/model.onnx: the u8u8 graph for CPUs without VNNI; None when not stored."""
    speed: dict[str, Any]
    """The build host's CPU and the median ms of the fp32 graph and each int8 graph on the check
    batch, measured side by side (`speed_on_build_host`), with the graph a model would open here."""


def verified_int8_graphs(module: Any, plain: Path, plain_report: VerificationReport, work: Path,
                         batches: Sequence[Any], *, one_graph: bool, log: Callable[[str], None] | None = None,
                         min_speedup: float | None = None, **options: Any) -> Int8Graphs:
    """The int8 graphs a build stores (model.onnx's, no-vnni/model.onnx's or None) and their speed here.

    int8 weights (u8s8) are exact and fast on VNNI/AMX CPUs only; uint8 weights (u8u8) are exact on
    every x86 CPU (quantization.py), so the build host's check of a u8u8 graph holds on every host.
    A host without VNNI checks each u8s8 candidate through its exact u8u8 twin (the integers VNNI hosts
    sum; `_as_vnni_hosts_compute`).
    Both ladders are tried: both pass, model.onnx is the u8s8 graph and no-vnni/ the u8u8 one (the
    served model opens the one its CPU computes exactly). `one_graph` (a backend that cannot choose
    at load, Triton's own ONNX Runtime backend): the u8u8 graph alone when it passes. Only the u8s8
    ladder passing: it alone, said in the log (the golden check refuses it on CPUs without VNNI).
    Neither: PrecisionError with both ladders' figures. The graph this host would serve is timed
    against the fp32 graph; slower than fp32 here, the log says so. `min_speedup` (`precision auto`:
    build_precision.py): PrecisionError, naming the times, when that graph runs at less than this
    many times the fp32 graph's speed here: int8 costs accuracy, kept only where it pays."""
    from .quantization import PORTABLE_WEIGHTS

    log = log or LOG.warning
    found: dict[str, VerifiedGraph] = {}
    errors: list[str] = []
    fused_graphs = FusedGraphs(plain, options.get("num_heads"), options.get("hidden_size"))
    for weights in ("int8", PORTABLE_WEIGHTS):
        try:
            found[weights] = optimize_and_verify(module, plain, plain_report, Path(f"{work}-{weights}"), batches,
                                                 precision=Precision.INT8, int8_weights=weights, log=log,
                                                 fused_graphs=fused_graphs, **options)
        except PrecisionError as err:
            errors.append(f"with {weights} weights: {err}")
    portable = found.get(PORTABLE_WEIGHTS)
    if "int8" in found and portable is not None:
        main, no_vnni = (portable, None) if one_graph else (found["int8"], portable)
    elif portable is not None:
        main, no_vnni = portable, None
    elif "int8" in found:
        log(f"{plain.parent.name}: only the int8-weight (u8s8) graph meets the int8 tolerance: it is exact on "
            "CPUs with VNNI or AMX; hosts without them will refuse it when it loads (its golden check)")
        main, no_vnni = found["int8"], None
    else:
        raise PrecisionError(" ".join(errors))
    speed = _speed_on_this_host(plain, Path(f"{work}-fp32"), main, no_vnni, batches[0], options, log, fused_graphs)
    if min_speedup is not None and speed["int8_vs_fp32"] < min_speedup:
        ms = speed["median_ms"]
        raise PrecisionError(
            f"{plain.parent.name}: the int8 graph this host opens ({speed['served_here']}) runs at "
            f"{speed['int8_vs_fp32']:.2f}x the fp32 graph's speed here ({ms[speed['served_here']]:.1f} vs "
            f"{ms['fp32']:.1f} ms on the check batch of shape {speed['batch_shape']}), under the {min_speedup:g}x "
            "that pays for int8's accuracy cost")
    return Int8Graphs(main, no_vnni, speed)


def _speed_on_this_host(plain: Path, work: Path, main: VerifiedGraph, no_vnni: VerifiedGraph | None,
                        batch: Any, options: dict[str, Any], log: Callable[[str], None],
                        fused_graphs: FusedGraphs | None = None) -> dict[str, Any]:
    """The fp32 graph as an fp32 build would store it and the int8 graphs, timed side by side on
    `batch` (median of interleaved runs); a log line when the int8 graph this host opens is slower."""
    from bionemo_export.serving.host import NO_VNNI_FOLDER, cpu_description, describe_cpu

    fp32 = plain
    if options.get("optimize", True):
        try:
            fp32 = optimize_onnx(plain, work / plain.name, num_heads=options.get("num_heads"),
                                 hidden_size=options.get("hidden_size"),
                                 fused=fused_graphs.get(True) if fused_graphs else None).path
        except OptimizationError:
            pass  # an fp32 build would store the plain export
    graphs = {"fp32": fp32, "model.onnx": main.path}
    if no_vnni is not None:
        graphs[f"{NO_VNNI_FOLDER}/model.onnx"] = no_vnni.path
    ms = time_graphs(graphs, batch)
    cpu = cpu_description()
    here = f"{NO_VNNI_FOLDER}/model.onnx" if no_vnni is not None and not cpu["vnni"] else "model.onnx"
    ratio = ms["fp32"] / ms[here] if ms[here] else float("inf")
    if ratio < 1.0:
        log(f"{plain.parent.name}: on this host ({describe_cpu(cpu)}) the int8 graph it would serve ({here}) runs "
            f"at {ratio:.2f}x the fp32 graph's speed ({ms[here]:.1f} vs {ms['fp32']:.1f} ms on the check batch): "
            "int8 gains no speed here (it keeps 4x smaller weights); build with `precision` fp32 for hosts like "
            "this one")
    return {"cpu": cpu, "batch_shape": list(np.shape(next(iter(batch.values())))), "median_ms": ms,
            "served_here": here, "int8_vs_fp32": round(ratio, 3)}


def time_graphs(graphs: dict[str, Path], batch: Any, rounds: int = 5) -> dict[str, float]:
    """Median milliseconds of one run of each graph on `batch`, the graphs interleaved run by run
    (so a busy moment of a shared host falls on all of them), after one warm-up run each."""
    import time

    import onnxruntime as ort

    from bionemo_export.exporters.runtime_session import session_options

    sessions, feeds = {}, {}
    for name, path in graphs.items():
        sessions[name] = ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])
        feeds[name] = {value.name: np.asarray(batch[value.name]) for value in sessions[name].get_inputs()}
        sessions[name].run(None, feeds[name])
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, session in sessions.items():
            start = time.perf_counter()
            session.run(None, feeds[name])
            times[name].append(time.perf_counter() - start)
    return {name: round(float(np.median(values)) * 1000, 2) for name, values in times.items()}
