"""Golden answers: a repository's Python-backend models check themselves on the host that serves them.

A build stores, beside each graph it verified, `golden.npz`: one batch of the graph's inputs, the
PyTorch fp32 outputs the graph was verified against, the tolerance it was held to, and the build
host's CPU and figures. A Python-backend model that runs the graph opens it with
onnx_session.create_session in its `initialize`, which calls check_at_load: the golden inputs run
once through the session and are compared; outside the tolerance the model refuses to load,
naming this host's CPU features, the tolerance and the figures (int8 kernels differ between CPUs,
see exporters/optimize/quantization.py). That is the model's own code, so it runs under any
tritonserver, started by `bionemo-export serve` or not. `BIONEMO_EXPORT_GOLDEN_CHECK=warn` in the
server's environment (`bionemo-export serve --golden-check warn`) serves it anyway, with a warning
in the server's log.

What this module does not reach: a graph served by Triton's own ONNX Runtime backend (`platform:
"onnxruntime_onnx"`, `--backend native`) runs none of this code; `bionemo-export serve` asks it for
its golden answers once the server is ready (runtime/golden_answers.py), and a plain tritonserver
does not check it. TensorRT engines are not checked against golden answers. `bionemo-export verify
REPO` without a checkpoint (verify.verify_golden) runs the golden inputs through each stored graph
with ONNX Runtime on the host verify runs on; it sends nothing to a server.

The file is read with numpy alone (no pickle): arrays `input:<name>` and `reference:<name>`, and
`meta`, a JSON string. This file is copied verbatim into generated Triton Python-backend model
folders, so it imports only the standard library, numpy and its sibling modules.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .host import cpu_description, describe_cpu
from .numerics import RowSums

GOLDEN_FILE = "golden.npz"
CHECK_ENV = "BIONEMO_EXPORT_GOLDEN_CHECK"
CHECK_MODES = ("refuse", "warn")
"""What a model does when its golden answers are outside tolerance: refuse to load (the default), or
load with a warning."""
FORMAT = 1


@dataclass(frozen=True)
class Figures:
    """One output against its reference: largest absolute difference, smallest cosine between
    corresponding vectors, and what is wrong beyond the figures (a shape mismatch)."""

    shape: tuple[int, ...]
    max_abs_error: float
    min_cosine: float
    problem: str | None = None

    def within(self, atol: float, min_cosine: float) -> bool:
        """Written as "within tolerance", so that NaN figures fail."""
        return self.problem is None and self.max_abs_error <= atol and self.min_cosine >= min_cosine


def compare(actual: np.ndarray, expected: np.ndarray, valid: np.ndarray | None = None) -> Figures:
    """Max abs error and min cosine of `actual` against `expected`, over one vector per valid
    position for [batch, length, ...] outputs when `valid` ([batch, length] booleans) is given
    (padded positions are don't-care), else one vector per item. NaN propagates, and fails.

    Computed in float64 a slice of rows (of a row's columns, for rows longer than that) at a time
    (COMPARE_CHUNK_BYTES), so that comparing large outputs costs a slice's temporaries, not ten
    times the output (measured: two 150 MB attention maps compared at once peaked 1.5 GB above
    them, now 85 MB; an ESM-2 35M build's peak did not move with it)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        return Figures(actual.shape, math.inf, -1.0,
                       f"shape {actual.shape} differs from the reference's {expected.shape}")
    largest: list[float] = []
    smallest: list[float] = []
    for rows_actual, rows_expected in zip(_row_slices(actual, valid), _row_slices(expected, valid)):
        if rows_actual.size:
            sums, step = None, _columns_at_once(rows_actual)  # a row longer than the chunk, in pieces
            for start in range(0, rows_actual.shape[1], step):
                piece_actual = rows_actual[:, start:start + step].astype(np.float64)
                piece_expected = rows_expected[:, start:start + step].astype(np.float64)
                largest.append(float(np.max(np.abs(piece_actual - piece_expected))))
                piece = RowSums.of(piece_actual, piece_expected)
                sums = piece if sums is None else sums.add(piece)
            assert sums is not None  # a slice with entries has columns
            smallest.append(float(np.min(sums.cosines())))
    if not largest:
        return Figures(actual.shape, 0.0, 1.0)
    return Figures(actual.shape, float(np.max(largest)), float(np.min(smallest)))  # np: NaN propagates


COMPARE_CHUNK_BYTES = 16 << 20
"""How many bytes of an output `compare` turns into float64 rows at once (at least one row)."""


def _row_slices(values: np.ndarray, valid: np.ndarray | None):
    """The vectors `compare` compares, [rows, width] slices in order: one per valid position of
    [batch, length, ...] outputs (item by item), else one per item; a vector, one row."""
    if values.ndim < 2:
        yield values.reshape(1, -1)
        return
    if valid is not None and values.shape[:2] == valid.shape:
        width = int(np.prod(values.shape[2:], dtype=np.int64))
        for item, keep in zip(values, valid):
            yield from _in_slices(item[keep].reshape(int(keep.sum()), width))
        return
    yield from _in_slices(values.reshape(values.shape[0], int(np.prod(values.shape[1:], dtype=np.int64))))


def _in_slices(rows: np.ndarray):
    step = max(1, COMPARE_CHUNK_BYTES // max(1, 8 * rows.shape[1]))
    for start in range(0, len(rows), step):
        yield rows[start:start + step]


def _columns_at_once(rows: np.ndarray) -> int:
    """Columns of `rows` whose float64 copy fits COMPARE_CHUNK_BYTES (at least one)."""
    return max(1, COMPARE_CHUNK_BYTES // max(1, 8 * len(rows)))


@dataclass(frozen=True)
class GoldenCheck:
    """One output's golden figures on this host and whether they are within its tolerance."""

    name: str
    figures: Figures
    atol: float
    min_cosine: float
    built: Mapping[str, Any] = field(default_factory=dict)
    """What the build host measured for this output ({max_abs_error, min_cosine}), when recorded."""

    @property
    def passed(self) -> bool:
        return self.figures.within(self.atol, self.min_cosine)

    def text(self) -> str:
        figures = self.figures
        parts = [figures.problem] if figures.problem else []
        parts.append(f"min cosine {figures.min_cosine:.6f} (required >= {self.min_cosine:g})")
        parts.append(f"max abs error {figures.max_abs_error:.3g}"
                     + (f" (allowed {self.atol:g})" if math.isfinite(self.atol) else ""))
        if "min_cosine" in self.built:
            parts.append(f"the build host measured min cosine {float(self.built['min_cosine']):.6f}")
        return f"{self.name}: " + ", ".join(parts)


@dataclass(frozen=True)
class Golden:
    """A graph's golden inputs, reference outputs and tolerance (golden.npz)."""

    inputs: dict[str, np.ndarray]
    references: dict[str, np.ndarray]
    mask_input: str
    """The [batch, length] input whose zeros mark padding ("" where outputs are compared whole)."""
    tolerances: dict[str, tuple[float, float]]
    """Output -> (atol, min_cosine)."""
    build: dict[str, Any]
    """The build host's CPU ({model, features, vnni}) and figures ({output: {max_abs_error, min_cosine}})."""

    def check(self, outputs: Mapping[str, np.ndarray]) -> list[GoldenCheck]:
        """`outputs` (the graph's answers to `inputs`) against the references."""
        valid = np.asarray(self.inputs[self.mask_input]) != 0 if self.mask_input in self.inputs else None
        figures = self.build.get("figures", {})
        return [GoldenCheck(name, compare(outputs[name], reference, valid), *self.tolerances[name],
                            built=figures.get(name, {}))
                for name, reference in self.references.items()]

    def run(self, session: Any) -> list[GoldenCheck]:
        """Run the golden inputs through an ONNX Runtime `session` and check its answers."""
        names = [value.name for value in session.get_inputs()]
        wanted = list(self.references)
        graph_outputs = {value.name for value in session.get_outputs()}
        if any(name not in self.inputs for name in names) or any(name not in graph_outputs for name in wanted):
            # Not the graph the build verified (a file swapped or copied from another model).
            problem = (f"the graph's inputs {names} and outputs {sorted(graph_outputs)} are not those of its golden "
                       f"answers ({sorted(self.inputs)} -> {wanted}): it is not the graph the build verified")
            return [GoldenCheck(name, Figures((), math.inf, -1.0, problem), *self.tolerances[name]) for name in wanted]
        answers = session.run(wanted, {name: self.inputs[name] for name in names})
        return self.check(dict(zip(wanted, (np.asarray(answer) for answer in answers))))


def write_golden(path: str, inputs: Mapping[str, np.ndarray], references: Mapping[str, np.ndarray], *,
                 mask_input: str, tolerances: Mapping[str, tuple[float, float]],
                 figures: Mapping[str, Mapping[str, float]] | None = None) -> None:
    """Write golden.npz at `path` (the build: the graph's verified inputs and PyTorch outputs)."""
    meta = {"format": FORMAT, "reference": "PyTorch fp32", "mask_input": mask_input,
            "tolerances": {name: {"atol": _number(atol), "min_cosine": cosine}
                           for name, (atol, cosine) in tolerances.items()},
            "build": {"cpu": cpu_description(), "figures": dict(figures or {})}}
    arrays = {f"input:{name}": np.ascontiguousarray(value) for name, value in inputs.items()}
    arrays.update({f"reference:{name}": np.ascontiguousarray(value, dtype=np.float32)
                   for name, value in references.items()})
    with open(path, "wb") as handle:
        np.savez_compressed(handle, meta=np.array(json.dumps(meta, sort_keys=True)), **arrays)


def read_golden(path: str) -> Golden:
    """golden.npz at `path`; ValueError naming the file when it is not one this code reads."""
    try:
        with np.load(path, allow_pickle=False) as stored:
            arrays = {name: stored[name] for name in stored.files}
        meta = json.loads(str(arrays.pop("meta")))
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{path}: not a golden-answers file ({err}); rebuild the repository") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: golden-answers format {meta.get('format')!r}, this code reads {FORMAT}")
    inputs = {name.split(":", 1)[1]: value for name, value in arrays.items() if name.startswith("input:")}
    references = {name.split(":", 1)[1]: value for name, value in arrays.items() if name.startswith("reference:")}
    tolerances = {name: (float(value["atol"]), float(value["min_cosine"]))
                  for name, value in meta["tolerances"].items()}
    return Golden(inputs, references, meta.get("mask_input", ""), tolerances, meta.get("build", {}))


def check_mode(environ: Mapping[str, str] | None = None) -> str:
    """CHECK_ENV's value ("refuse" when unset); ValueError for another."""
    mode = (os.environ if environ is None else environ).get(CHECK_ENV, "") or "refuse"
    if mode not in CHECK_MODES:
        raise ValueError(f"{CHECK_ENV}={mode!r}: choose one of {', '.join(CHECK_MODES)}")
    return mode


def golden_path(graph: str) -> str:
    """Where the golden answers of the ONNX file `graph` are: GOLDEN_FILE beside a `model.onnx`;
    `<stem>.golden.npz` beside another graph of the folder (the graphs N_encoder hosts:
    model_repository/hosted_graphs.py)."""
    folder, name = os.path.split(graph)
    stem = name[:-len(".onnx")] if name.endswith(".onnx") else name
    return os.path.join(folder, GOLDEN_FILE if stem == "model" else f"{stem}.{GOLDEN_FILE}")


def check_at_load(session: Any, graph: str, model_name: str, warn: Any = None) -> list[GoldenCheck]:
    """Run the golden answers stored beside `graph` (an ONNX file) through `session`, as a served
    model does when it loads. Outside tolerance: RuntimeError naming the model, this host's CPU,
    the build host's, the tolerance and the figures, unless CHECK_ENV is "warn" (then `warn`, a
    callable taking the message, is called). No golden file (a repository built before golden
    answers): nothing to check, []."""
    path = golden_path(graph)
    if not os.path.exists(path):
        path = os.path.join(os.path.dirname(os.path.dirname(graph)), GOLDEN_FILE)  # a CPU variant's folder
        if not os.path.exists(path):
            return []
    mode = check_mode()
    golden = read_golden(path)
    checks = golden.run(session)
    failed = [check for check in checks if not check.passed]
    if failed:
        message = refusal(model_name, graph, failed, golden.build)
        if mode == "refuse":
            raise RuntimeError(message)
        if warn is not None:
            warn(message + f" (served anyway: {CHECK_ENV}=warn)")
    return checks


def refusal(model_name: str, graph: str, failed: Sequence[GoldenCheck], build: Mapping[str, Any]) -> str:
    """Why a model is not served on this host: the figures, both hosts' CPUs, what to do."""
    built_on = build.get("cpu")
    return (f"{model_name}: {graph} answers the build's golden inputs outside its tolerance on this host: "
            + "; ".join(check.text() for check in failed)
            + f". This host: {describe_cpu()}."
            + (f" The build host: {describe_cpu(dict(built_on))}." if built_on else "")
            + " Its answers here would be wrong: rebuild the repository with this bionemo-export (an int8 build "
              "stores a graph that is exact on CPUs without VNNI), or serve it on a host like the build host; "
              f"to serve it anyway, set {CHECK_ENV}=warn in the server's environment "
              "(`bionemo-export serve --golden-check warn`).")


def _number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)
