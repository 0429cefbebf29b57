"""The typed records a build writes into manifest.json (build_records.py, exporters/optimize/pipeline.py)
write the JSON builds wrote before them: the same keys, in the same order, with the same values. The
expected dicts below are that format, written out; repositories built before read the same, and
tools reading manifest.json see no change."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bionemo_export.build_records import AccuracyRecord, GraphRecord, GraphVerification
from bionemo_export.choices import Exporter, OptimizationLevel, Precision
from bionemo_export.exporters.onnx_export import ExportResult
from bionemo_export.exporters.optimize import (
    CandidateFigures,
    Int8Quantization,
    OptimizationRecord,
    OptimizationResult,
    RejectedCandidate,
)
from bionemo_export.exporters.verification import OutputCheck, Tolerance, VerificationReport


def _same_json(actual: dict, expected: dict) -> None:
    """Equal and in the same key order (manifest.json is written in insertion order)."""
    assert json.dumps(actual) == json.dumps(expected)


EXPORT = ExportResult(path=Path("/tmp/build/tmp/onnx/encoder/model.onnx"), exporter=Exporter.TORCH,
                      torch_exporter="dynamo",
                      opset=18, external_data=True, data_path=Path("/tmp/build/tmp/onnx/encoder/model.onnx.data"),
                      onnx_bytes=10, data_bytes=20, parameters=3, weight_bytes=12, seconds=1.5,
                      versions={"torch": "2"}, warnings=("a warning",))
INT8 = OptimizationResult(path=Path("/tmp/build/tmp/onnx/encoder.optimized/int8-1/model.onnx"),
                          precision=Precision.INT8, level=OptimizationLevel.EXTENDED,
                          applied=("attention_fusion(MultiHeadAttention x2)", "quantize_dynamic(int8)"),
                          fused={"MultiHeadAttention": 2}, skipped=("transformer_fusions: reason",), nodes_before=100,
                          nodes_after=50, external_data=False, bytes=1234, seconds=0.5,
                          versions={"onnxruntime": "1", "onnx": "2"},
                          serving_graph_optimization_level="ORT_ENABLE_BASIC",
                          quantization=Int8Quantization(method="dynamic", keep_fp32=0.25, kept_fp32=["matmul_7"],
                                                        kept_fp32_chosen_by="error", matmuls_int8=11, matmuls_fp32=1))
REJECTED = (RejectedCandidate({}, applied=("quantize_dynamic(int8)",),
                              figures={"embeddings": CandidateFigures(0.5, 0.998, 0.999)}),
            RejectedCandidate({"keep_fp32": 0.5}, error="OptimizationError: it broke"))


def _report(path: str, *, tolerance: Tolerance | None = None) -> VerificationReport:
    checks = (OutputCheck("hiddens", 1e-5, 0.99999, ((2, 7, 8),), True, None, tolerance),
              OutputCheck("embeddings", math.inf, -1.0, ((2, 8),), False, "ONNX shape differs", tolerance))
    return VerificationReport(Path(path), atol=1e-4, min_cosine=0.9999, batch_shapes=((2, 7),), outputs=checks,
                              seconds=0.25)


def test_an_optimized_graph_record_is_the_optimization_result_with_its_fallback_and_rejections():
    _same_json(OptimizationRecord(INT8, rejected=REJECTED).to_dict(), {
        "path": "model.onnx", "precision": "int8", "level": "extended",
        "applied": ["attention_fusion(MultiHeadAttention x2)", "quantize_dynamic(int8)"],
        "fused": {"MultiHeadAttention": 2}, "skipped": ["transformer_fusions: reason"], "nodes_before": 100,
        "nodes_after": 50, "external_data": False, "bytes": 1234, "seconds": 0.5,
        "versions": {"onnxruntime": "1", "onnx": "2"}, "serving_graph_optimization_level": "ORT_ENABLE_BASIC",
        "quantization": {"method": "dynamic", "keep_fp32": 0.25, "kept_fp32": ["matmul_7"],
                         "kept_fp32_chosen_by": "error", "matmuls_int8": 11, "matmuls_fp32": 1,
                         "weights": "int8"},
        "fallback": None,
        "rejected": [{"options": {}, "applied": ["quantize_dynamic(int8)"],
                      "figures": {"embeddings": {"max_abs_error": 0.5, "min_cosine": 0.998,
                                                 "required_min_cosine": 0.999}}},
                     {"options": {"keep_fp32": 0.5}, "error": "OptimizationError: it broke"}],
    })
    assert OptimizationRecord(INT8).to_dict()["rejected"] == []


def test_a_plain_export_record_says_why_and_lists_rejections_only_when_some_were_tried():
    plain = {"precision": "fp32", "applied": [], "fused": {}, "level": "none",
             "serving_graph_optimization_level": "ORT_ENABLE_ALL"}
    _same_json(OptimizationRecord(None, fallback="not asked (--no-optimize)").to_dict(),
               {**plain, "fallback": "not asked (--no-optimize)"})
    _same_json(OptimizationRecord(None, fallback="the optimized graph failed", rejected=REJECTED[1:]).to_dict(),
               {**plain, "fallback": "the optimized graph failed",
                "rejected": [{"options": {"keep_fp32": 0.5}, "error": "OptimizationError: it broke"}]})
    record = OptimizationRecord(None, fallback="reason")
    assert (record.precision, record.serving_graph_optimization_level) == ("fp32", "ORT_ENABLE_ALL")
    assert OptimizationRecord(INT8).serving_graph_optimization_level == "ORT_ENABLE_BASIC"


def test_a_graph_record_names_the_files_as_the_repository_has_them():
    optimization = OptimizationRecord(None, fallback="reason")
    _same_json(GraphRecord(EXPORT, optimization).to_dict(), {
        "path": "model.onnx", "exporter": "torch", "torch_exporter": "dynamo", "opset": 18, "external_data": True,
        "data_path": "model.onnx.data", "onnx_bytes": 10, "data_bytes": 20, "parameters": 3, "weight_bytes": 12,
        "seconds": 1.5, "versions": {"torch": "2"}, "warnings": ["a warning"],
        "optimization": optimization.to_dict(),
    })
    # int8: the graph for CPUs without VNNI and the build host's timing follow, when there are some
    speed = {"cpu": {"model": "x", "features": ["avx2"], "vnni": False}, "median_ms": {"fp32": 2.0}}
    record = GraphRecord(EXPORT, optimization, OptimizationRecord(INT8), speed).to_dict()
    assert list(record)[-3:] == ["optimization", "optimization_no_vnni", "int8_speed_on_build_host"]
    assert record["optimization_no_vnni"] == OptimizationRecord(INT8).to_dict()
    assert record["int8_speed_on_build_host"] == speed


def test_a_verification_record_is_the_stored_graphs_report_with_the_plain_exports_outputs():
    stored = _report("/tmp/build/tmp/onnx/encoder.optimized/fp32-0/model.onnx")
    plain = _report("/tmp/build/tmp/onnx/encoder/model.onnx")
    report = stored.to_dict()
    expected = {**report, "onnx_path": "model.onnx", "precision": "fp32", "optimized": True,
                "unoptimized": {"outputs": [check.to_dict() for check in plain.outputs]}}
    assert list(expected)[0] == "onnx_path" and expected["outputs"][1]["max_abs_error"] == "inf"
    _same_json(GraphVerification(stored, EXPORT.path, "fp32", unoptimized=plain).to_dict(), expected)
    _same_json(GraphVerification(plain, EXPORT.path, "fp32").to_dict(),
               {**plain.to_dict(), "onnx_path": "model.onnx", "precision": "fp32", "optimized": False})
    _same_json(GraphVerification(plain, EXPORT.path, "int8", no_vnni=stored).to_dict(),
               {**plain.to_dict(), "onnx_path": "model.onnx", "precision": "int8", "optimized": False,
                "no_vnni": {"outputs": [check.to_dict() for check in stored.outputs]}})


def test_the_accuracy_record_holds_each_output_to_its_own_tolerance_or_the_familys():
    family = _report("/x/model.onnx")
    _same_json(AccuracyRecord("fp32", GraphVerification(family, EXPORT.path, "fp32")).to_dict(), {
        "precision": "fp32", "reference": "PyTorch fp32", "graph": "encoder", "batch_shapes": [[2, 7]],
        "outputs": {"hiddens": {"max_abs_error": 1e-5, "min_cosine": 0.99999,
                                "tolerance": {"atol": 1e-4, "min_cosine": 0.9999}},
                    "embeddings": {"max_abs_error": "inf", "min_cosine": -1.0,
                                   "tolerance": {"atol": 1e-4, "min_cosine": 0.9999}}},
    })
    int8 = _report("/x/model.onnx", tolerance=Tolerance(math.inf, 0.999))
    outputs = AccuracyRecord("int8", GraphVerification(int8, EXPORT.path, "int8")).to_dict()["outputs"]
    assert outputs["embeddings"]["tolerance"] == {"atol": "inf", "min_cosine": 0.999}
