"""What a build records about each graph in manifest.json, as typed records.

    record = GraphRecord(export_result, chosen.record)                     # manifest["export"][graph]
    check = GraphVerification(chosen.report, export_result.path, "fp32",   # manifest["verification"]
                              unoptimized=None)                            #   ["graphs"][graph]
    AccuracyRecord("int8", check, chosen.record).to_dict()                 # manifest["accuracy"]

Each `to_dict()` writes the manifest's JSON as it has always been written (the same keys, in the
same order): repositories built before read the same, and tools reading manifest.json need no change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bionemo_export.exporters.onnx_export import ExportResult
    from bionemo_export.exporters.optimize import OptimizationRecord
    from bionemo_export.exporters.verification import VerificationReport


@dataclass(frozen=True)
class GraphRecord:
    """manifest.json's `export.<graph>`: how the graph was exported, and what the build stored of it."""

    export: ExportResult
    optimization: OptimizationRecord
    """The optimized graph stored, or why the plain export was."""
    no_vnni: OptimizationRecord | None = None
    """int8: the graph stored for CPUs without VNNI (no-vnni/model.onnx), when there is one."""
    int8_speed: dict[str, Any] | None = None
    """int8: the fp32 and int8 graphs timed side by side on the build host (pipeline.Int8Graphs.speed)."""

    def to_dict(self) -> dict[str, Any]:
        record = self.export.to_dict()
        # The export happened in a temporary folder: record the names the files have in the repository.
        record["path"] = self.export.path.name
        record["data_path"] = self.export.data_path.name if self.export.data_path else None
        record["optimization"] = self.optimization.to_dict()
        if self.no_vnni is not None:
            record["optimization_no_vnni"] = self.no_vnni.to_dict()
        if self.int8_speed is not None:
            record["int8_speed_on_build_host"] = self.int8_speed
        return record


@dataclass(frozen=True)
class GraphVerification:
    """manifest.json's `verification.graphs.<graph>`: the stored graph checked against PyTorch."""

    report: VerificationReport
    """The check of the graph stored."""
    exported: Path
    """The plain export (its file name is recorded)."""
    precision: str
    unoptimized: VerificationReport | None = None
    """The plain export's check, when the graph stored is an optimized one."""
    no_vnni: VerificationReport | None = None
    """int8: the check of the graph stored for CPUs without VNNI, when there is one."""

    @property
    def optimized(self) -> bool:
        return self.unoptimized is not None

    def to_dict(self) -> dict[str, Any]:
        result = {**self.report.to_dict(), "onnx_path": self.exported.name, "precision": self.precision,
                  "optimized": self.optimized}
        if self.unoptimized is not None:
            result["unoptimized"] = {"outputs": [check.to_dict() for check in self.unoptimized.outputs]}
        if self.no_vnni is not None:
            result["no_vnni"] = {"outputs": [check.to_dict() for check in self.no_vnni.outputs]}
        return result


@dataclass(frozen=True)
class AccuracyRecord:
    """manifest.json's `accuracy`: the stored encoder graph against the PyTorch fp32 model, what
    `precision` costs. A quantized graph (int8, int8w, int4) also records the min cosine its build
    required (`required_min_cosine`: the tolerance with its margin, exporters/optimize/pipeline.py),
    each served session it was checked in (`sessions`), and, for int8w/int4, how it was quantized
    (`quantization`: bits, block size, accuracy level, the MatMuls kept, the weight bytes)."""

    precision: str
    encoder: GraphVerification
    optimization: OptimizationRecord | None = None
    """The stored graph's optimization record (its quantization), when known."""

    def to_dict(self) -> dict[str, Any]:
        from bionemo_export.choices import Precision
        from bionemo_export.exporters.optimize.pipeline import MARGIN_SHARE, margin_min_cosine
        from bionemo_export.exporters.verification import Tolerance

        report = self.encoder.report
        quantized = self.precision in tuple(Precision) and Precision(self.precision).quantized
        outputs = {}
        for check in (check.to_dict() for check in report.outputs):
            # An output held to the family's tolerance records it here (the report's own has no entry).
            tolerance = check.get("tolerance") or Tolerance(report.atol, report.min_cosine).to_dict()
            outputs[check["name"]] = {"max_abs_error": check["max_abs_error"], "min_cosine": check["min_cosine"],
                                      "tolerance": tolerance}
            if quantized:
                outputs[check["name"]]["required_min_cosine"] = round(margin_min_cosine(tolerance["min_cosine"]), 9)
        record: dict[str, Any] = {
            "precision": self.precision,
            "reference": "PyTorch fp32",
            "graph": "encoder",
            "batch_shapes": [list(shape) for shape in report.batch_shapes],
            "outputs": outputs,
        }
        if quantized:
            record["margin_share"] = MARGIN_SHARE
            record["sessions"] = report.sessions
        result = self.optimization.result if self.optimization is not None else None
        if result is not None and result.quantization is not None and self.precision in ("int8w", "int4"):
            record["quantization"] = result.quantization.to_dict()
        return record
