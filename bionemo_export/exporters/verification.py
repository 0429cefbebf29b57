"""Verify an exported ONNX graph against the PyTorch module it came from.

Both run on the same batches (ONNX Runtime on CPU, the module under torch.inference_mode); for
each output we record the largest absolute difference and the smallest cosine similarity between
corresponding vectors (one per item, or one per valid position for per-position outputs). Padded
positions are don't-care: for an output whose leading axes are [batch, length], only positions
where the attention mask is 1 are compared. The check really fails: any NaN, shape mismatch or
figure over tolerance makes `passed` False and `raise_for_tolerance()` raise.

Tolerances: fp32 graphs use the model family's (atol and min cosine for every output). Reduced
precision graphs use `precision_tolerances(precision, ...)`: min cosine per output only (an
absolute error bound would depend on each model's activation scale), with the max abs error still
measured and recorded as the accuracy cost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from bionemo_export.choices import Precision
from bionemo_export.errors import UserError
from bionemo_export.exporters.runtime_session import session_options
from bionemo_export.models.readers.mapped import return_freed_memory
from bionemo_export.serving.golden import Figures, compare

DEFAULT_MASK_INPUT = "attention_mask"

PRECISION_MIN_COSINE: dict[str, dict[str, float]] = {
    # int8 (dynamic quantization) against PyTorch fp32. Embeddings: the target (AntiBERTy
    # measured 0.9987 fully int8 on a 5-residue sequence batched with 120-residue ones, 0.9991 with
    # 2 of its 8 feed-forward outputs kept fp32). Per-position hiddens average nothing: 0.99
    # (AntiBERTy 0.998).
    "int8": {"embeddings": 0.999, "hiddens": 0.99},
    # Weight-only (exporters/optimize/weight_only.py). int8w: the target for the real
    # AntiBERTy's embeddings (measured 0.99977), hidden states 0.999 (0.99961). int4: what 4-bit
    # blocks keep of AntiBERTy on the build's check batches, whose 5-residue fragment is the worst
    # case (embeddings 0.973, hidden states 0.966 with every product at 4 bits; full heavy chains
    # 0.991: docs/building.md).
    "int8w": {"embeddings": 0.9995, "hiddens": 0.999},
    "int4": {"embeddings": 0.97, "hiddens": 0.96},
    # fp16 weights and compute (AntiBERTy measured 0.999999 for both).
    "fp16": {"embeddings": 0.9999, "hiddens": 0.999},
}
"""Reduced-precision tolerance: the smallest cosine allowed per encoder output against fp32."""
DEFAULT_REDUCED_MIN_COSINE = {"int8": 0.99, "int8w": 0.999, "int4": 0.96, "fp16": 0.999}
"""For outputs PRECISION_MIN_COSINE does not name."""


@dataclass(frozen=True)
class Tolerance:
    """What one output must meet: max abs error <= atol and min cosine >= min_cosine."""

    atol: float
    min_cosine: float

    def to_dict(self) -> dict[str, Any]:
        return {"atol": _json_float(self.atol), "min_cosine": self.min_cosine}


def precision_tolerances(precision: Precision | str, output_names: Sequence[str], atol: float, min_cosine: float,
                         asked: float | None = None) -> dict[str, Tolerance]:
    """The tolerance per output for a graph of `precision` compared with PyTorch fp32: the family's
    (`atol`, `min_cosine`) for fp32; min cosine only (atol not checked: inf) for the reduced
    precisions (int8, int8w, int4, fp16): PRECISION_MIN_COSINE's, or `asked` for every output
    (the build's `min_cosine`: a user accepting a graph further from fp32)."""
    if precision == Precision.FP32:
        return {name: Tolerance(atol, min_cosine) for name in output_names}
    if precision not in PRECISION_MIN_COSINE:
        raise ValueError(f"unknown precision {precision!r}; choose fp32, {', '.join(PRECISION_MIN_COSINE)}")
    if asked is not None:
        return {name: Tolerance(math.inf, asked) for name in output_names}
    table = PRECISION_MIN_COSINE[precision]
    return {name: Tolerance(math.inf, table.get(name, DEFAULT_REDUCED_MIN_COSINE[precision]))
            for name in output_names}


@dataclass(frozen=True)
class OutputCheck:
    """How one output of the graph compared with PyTorch over all batches."""

    name: str
    max_abs_error: float
    min_cosine: float
    shapes: tuple[tuple[int, ...], ...]
    """The output's shape in each batch."""
    passed: bool
    problem: str | None = None
    """Why it failed beyond the figures (a shape mismatch), if so."""
    tolerance: Tolerance | None = None
    """The tolerance this output was held to, when it differs from the report's."""

    def to_dict(self) -> dict[str, Any]:
        result = {
            "name": self.name,
            "max_abs_error": _json_float(self.max_abs_error),
            "min_cosine": _json_float(self.min_cosine),
            "shapes": [list(shape) for shape in self.shapes],
            "passed": self.passed,
            "problem": self.problem,
        }
        if self.tolerance is not None:
            result["tolerance"] = self.tolerance.to_dict()
        return result


@dataclass(frozen=True)
class VerificationReport:
    """The result of `verify_onnx`, for the build log and manifest.json."""

    onnx_path: Path
    atol: float
    min_cosine: float
    batch_shapes: tuple[tuple[int, ...], ...]
    """The shape of the first input in each batch checked (batch, length)."""
    outputs: tuple[OutputCheck, ...]
    seconds: float
    sessions: dict[str, dict[str, float]] = field(default_factory=dict)
    """When the graph ran in several sessions (verify_onnx's `sessions`): each one's min cosine per
    output over the batches; the outputs' figures are the worst of them."""

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.outputs)

    @property
    def failures(self) -> tuple[OutputCheck, ...]:
        return tuple(check for check in self.outputs if not check.passed)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (non-finite figures as strings, since JSON has no NaN)."""
        return {
            "onnx_path": str(self.onnx_path),
            "passed": self.passed,
            "atol": _json_float(self.atol),
            "min_cosine": self.min_cosine,
            "batches": len(self.batch_shapes),
            "batch_shapes": [list(shape) for shape in self.batch_shapes],
            "outputs": [check.to_dict() for check in self.outputs],
            "seconds": self.seconds,
            **({"sessions": self.sessions} if self.sessions else {}),
        }

    def raise_for_tolerance(self) -> None:
        """Raise ExportVerificationError if any output is over tolerance."""
        if not self.passed:
            raise ExportVerificationError(self)


class ExportVerificationError(UserError, RuntimeError):
    """The exported graph disagrees with PyTorch; `.report` has the figures."""

    def __init__(self, report: VerificationReport) -> None:
        self.report = report
        lines = [
            f"{report.onnx_path} disagrees with PyTorch beyond tolerance (atol {report.atol:g}, "
            f"min cosine {report.min_cosine:g}) over {len(report.batch_shapes)} batches "
            f"of shapes {[list(s) for s in report.batch_shapes]}:"
        ]
        for check in report.failures:
            tolerance = check.tolerance or Tolerance(report.atol, report.min_cosine)
            figures = [
                f"max abs error {check.max_abs_error:.3g} (allowed {tolerance.atol:g})",
                f"min cosine {check.min_cosine:.6f} (required {tolerance.min_cosine:g})",
            ]
            if check.problem:
                figures.insert(0, check.problem)
            lines.append(f"  {check.name}: " + "; ".join(figures))
        lines.append(
            "The graph is wrong for some inputs: look at the export's warnings (a traced constant "
            "or a fixed shape), try the other exporter, or, if the difference is expected "
            "(reduced precision), raise the model family's atol/min_cosine."
        )
        super().__init__("\n".join(lines))


class ReferenceAnswers:
    """PyTorch's answers of one module on one list of check batches, computed the first time a graph
    is checked against them and read by every later check: a build checks the plain export, each
    optimization candidate and the golden answers on the same batches (before, an fp32 build ran
    the model on them 7 times instead of 3, and AntiBERTy's int8 ladder 25 times). After the
    batches have run, the module's memory-mapped weights are handed back to the kernel
    (models/readers/mapped.py): the model and a graph's session are never resident together.
    The answers stay in memory while the build tries the graph's candidates (a build makes one per
    graph and drops it when the graph is stored): small beside the weights (ESM-2 3B's attentions
    graph, the largest answer, on the family's six check samples: about 0.6 GB, against 11 GB)."""

    def __init__(self, module: torch.nn.Module, batches: Sequence[Mapping[str, np.ndarray]]) -> None:
        if not batches:
            raise ValueError("a reference needs at least one batch")
        self.module, self.batches = module, batches
        self._answers: dict[tuple[tuple[str, ...], tuple[str, ...]], list[dict[str, np.ndarray]]] = {}

    def on(self, input_names: Sequence[str], output_names: Sequence[str]) -> list[dict[str, np.ndarray]]:
        """The module's outputs on each batch (fed the inputs `input_names` positionally), named
        `output_names` in order (a graph's input and output names)."""
        key = (tuple(input_names), tuple(output_names))
        if key not in self._answers:
            for index, batch in enumerate(self.batches):
                if missing := [name for name in input_names if name not in batch]:
                    raise ValueError(f"batch {index} lacks the graph inputs {missing}")
            self._answers[key] = [_run_reference(self.module, [batch[n] for n in input_names], list(output_names))
                                  for batch in self.batches]
            release_weights(self.module)
        return self._answers[key]


def verify_onnx(
    reference_module: torch.nn.Module,
    onnx_path: Path,
    batches: Sequence[Mapping[str, np.ndarray]],
    *,
    atol: float,
    min_cosine: float,
    output_names: Sequence[str] | None = None,
    mask_input: str = DEFAULT_MASK_INPUT,
    tolerances: Mapping[str, Tolerance] | None = None,
    sessions: Mapping[str, ort.SessionOptions] | None = None,
    answers: ReferenceAnswers | None = None,
) -> VerificationReport:
    """Run the graph and `reference_module` (forward takes the graph's inputs positionally, in
    graph order, and returns its outputs in graph order) on every batch and compare the outputs
    named in `output_names` (default: all). `mask_input` names the [batch, length] input whose
    zeros mark padded positions. `tolerances` overrides (atol, min_cosine) per output name (see
    `precision_tolerances`). `sessions`: label -> the ONNX Runtime options to run the graph under,
    one session after the other against the same PyTorch outputs (a quantized graph as its served
    sessions open it: exporters/optimize/pipeline.py); each output's figures are the worst over
    them, each session's in `report.sessions`. Default: one build session (`session_options()`).
    `answers`: the module's outputs on `batches` kept from an earlier check of another graph
    (ReferenceAnswers of this module and these batches); None runs the module here.
    Does not raise on disagreement: see `raise_for_tolerance()`."""
    if not batches:
        raise ValueError("verify_onnx needs at least one batch")
    if answers is None:
        answers = ReferenceAnswers(reference_module, batches)
    elif answers.module is not reference_module or answers.batches is not batches:
        raise ValueError("verify_onnx: `answers` were computed for another module or other batches")
    start = time.perf_counter()
    external = has_external_data(Path(onnx_path))
    runs = dict(sessions) if sessions else {"build": session_options(mapped_weights=external)}
    comparisons: dict[str, list[Figures]] = {}
    per_session: dict[str, dict[str, float]] = {}
    input_names, graph_outputs = graph_names(Path(onnx_path))
    names = list(output_names) if output_names is not None else graph_outputs
    if unknown := [name for name in names if name not in graph_outputs]:
        raise ValueError(f"{onnx_path} has no outputs {unknown}; its outputs are {graph_outputs}")
    # PyTorch first (or its kept answers), then the sessions: the module's weights and a session's
    # are never resident together (ReferenceAnswers).
    references = answers.on(input_names, graph_outputs)
    batch_shapes = [tuple(np.shape(batch[input_names[0]])) for batch in batches]
    data = Path(onnx_path).with_name(Path(onnx_path).name + ".data")
    graph_bytes = Path(onnx_path).stat().st_size + (data.stat().st_size if data.is_file() else 0)
    for label, options in runs.items():
        session = _session(Path(onnx_path), options)
        found: dict[str, list[Figures]] = {name: [] for name in names}
        for index, batch in enumerate(batches):
            # Tensor outputs come back as arrays (ONNX Runtime's stubs also allow lists and sparse tensors).
            onnx_values = {name: np.asarray(value) for name, value in
                           zip(graph_outputs, session.run(None, {n: batch[n] for n in input_names}))}
            valid = np.asarray(batch[mask_input]) != 0 if mask_input in batch else None
            for name in names:
                found[name].append(compare(onnx_values[name], references[index][name], valid))
        del session
        return_freed_memory(graph_bytes)  # the session's weights and arena, before the next session or step
        per_session[label] = {name: float(np.min([f.min_cosine for f in figures])) for name, figures in found.items()}
        for name, figures in found.items():
            comparisons.setdefault(name, []).extend(figures)

    tolerances = dict(tolerances or {})
    checks = tuple(
        _summarize(name, results, atol=tolerances[name].atol if name in tolerances else atol,
                   min_cosine=tolerances[name].min_cosine if name in tolerances else min_cosine,
                   tolerance=tolerances.get(name))
        for name, results in comparisons.items()
    )
    return VerificationReport(
        onnx_path=Path(onnx_path),
        atol=atol,
        min_cosine=min_cosine,
        batch_shapes=tuple(batch_shapes),
        outputs=checks,
        seconds=round(time.perf_counter() - start, 3),
        sessions=per_session if sessions else {},
    )


def graph_names(onnx_path: Path) -> tuple[list[str], list[str]]:
    """(input names, output names) of the graph at `onnx_path`, read without its external data
    (no session: opening one would load every weight)."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    initializers = {tensor.name for tensor in graph.initializer}  # old exports list them as inputs too
    return [value.name for value in graph.input if value.name not in initializers], [v.name for v in graph.output]


def has_external_data(onnx_path: Path) -> bool:
    """Whether the graph keeps its weights beside it (`<name>.onnx.data`, as the exporters write them)."""
    return onnx_path.with_name(onnx_path.name + ".data").exists()


def release_weights(module: torch.nn.Module) -> int:
    """Hand the pages of `module`'s memory-mapped weights back to the kernel (they are read from
    the checkpoint again when next used: models/readers/mapped.py); the bytes advised."""
    from bionemo_export.models.readers.mapped import page_out

    return page_out([*module.parameters(), *module.buffers()])


def _session(onnx_path: Path, options: ort.SessionOptions | None = None) -> ort.InferenceSession:
    """A CPU session with `options`; by default ONNX Runtime's default thread count and its idle
    threads asleep, as a served model runs it (runtime_session.py)."""
    return ort.InferenceSession(str(onnx_path), options or session_options(), providers=["CPUExecutionProvider"])


def _run_reference(
    module: torch.nn.Module, arguments: list[np.ndarray], output_names: list[str]
) -> dict[str, np.ndarray]:
    """The module's outputs on the batch, named like the graph's outputs."""
    with torch.inference_mode():
        result = module(*(torch.from_numpy(np.ascontiguousarray(a)) for a in arguments))
    values = (result,) if isinstance(result, torch.Tensor) else tuple(result)
    if len(values) != len(output_names):
        raise ValueError(
            f"the reference module returned {len(values)} outputs; the graph has {output_names}"
        )
    return {name: value.detach().float().numpy() for name, value in zip(output_names, values)}


def _summarize(
    name: str, results: list[Figures], *, atol: float, min_cosine: float, tolerance: Tolerance | None = None
) -> OutputCheck:
    """Worst figures over all batches. np.max/np.min, unlike max()/min(), propagate NaN."""
    max_abs = float(np.max([r.max_abs_error for r in results]))
    min_cos = float(np.min([r.min_cosine for r in results]))
    problem = next((r.problem for r in results if r.problem), None)
    # Written as "within tolerance" so that NaN (every comparison False) fails.
    passed = problem is None and max_abs <= atol and min_cos >= min_cosine
    return OutputCheck(
        name=name,
        max_abs_error=max_abs,
        min_cosine=min_cos,
        shapes=tuple(r.shape for r in results),
        passed=passed,
        problem=problem,
        tolerance=tolerance,
    )


def _json_float(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


def write_golden_answers(answers: ReferenceAnswers, report: VerificationReport, destination: Path, *,
                         mask_input: str = DEFAULT_MASK_INPUT) -> Path:
    """Store the first of the batches `report` checked (`answers`'), the module's outputs on it
    and the tolerance `report` held the graph to as `destination`/golden.npz (serving/golden.py),
    which the served model checks on its host when it loads."""
    from bionemo_export.serving.golden import GOLDEN_FILE, write_golden

    input_names, graph_outputs = graph_names(report.onnx_path)
    batch, outputs = answers.batches[0], answers.on(input_names, graph_outputs)[0]
    checked = {check.name: check for check in report.outputs}
    tolerances = {name: check.tolerance or Tolerance(report.atol, report.min_cosine)
                  for name, check in checked.items()}
    Path(destination).mkdir(parents=True, exist_ok=True)
    path = Path(destination) / GOLDEN_FILE
    write_golden(str(path), {name: np.asarray(batch[name]) for name in input_names},
                 {name: outputs[name] for name in checked},
                 mask_input=mask_input if mask_input in input_names else "",
                 tolerances={name: (t.atol, t.min_cosine) for name, t in tolerances.items()},
                 figures={name: {"max_abs_error": check.max_abs_error, "min_cosine": check.min_cosine}
                          for name, check in checked.items()})
    return path
