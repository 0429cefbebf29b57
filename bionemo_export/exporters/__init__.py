"""Exporting encoder graphs to ONNX (torch.onnx, or Triton Model Navigator when installed) and
verifying them against PyTorch.

    result = export_onnx(model.encoder, model.inputs, model.outputs, sample, out / "model.onnx")
    report = verify_onnx(model.encoder, result.path, batches, atol=family.atol,
                         min_cosine=family.min_cosine)
    report.raise_for_tolerance()
    chosen = optimize_and_verify(model.encoder, result.path, report, work, batches, num_heads=8,
                                 hidden_size=512, atol=family.atol, min_cosine=family.min_cosine,
                                 output_names=["hiddens", "embeddings"], mask_input="attention_mask",
                                 precision="int8")   # optimized (+ int8) graph, verified, or the plain one
    head = export_lm_head(model, out)     # the masked-LM head as out/lm_head.onnx, verified
"""

from bionemo_export.exporters.lm_head import LMHeadExport, NoLMHeadError, export_lm_head, lm_head_check_batches
from bionemo_export.exporters.navigator import NavigatorExportError, NavigatorUnavailableError
from bionemo_export.exporters.onnx_export import (
    ExportError,
    ExportResult,
    available_exporters,
    export_onnx,
    tensorrt_available,
)
from bionemo_export.exporters.optimize import (
    OptimizationError,
    OptimizationResult,
    PrecisionError,
    VerifiedGraph,
    fuse_attention,
    optimize_and_verify,
    optimize_onnx,
)
from bionemo_export.exporters.signature import SignatureError
from bionemo_export.exporters.verification import (
    ExportVerificationError,
    OutputCheck,
    Tolerance,
    VerificationReport,
    precision_tolerances,
    verify_onnx,
)

__all__ = [
    "ExportError",
    "ExportResult",
    "ExportVerificationError",
    "LMHeadExport",
    "NavigatorExportError",
    "NavigatorUnavailableError",
    "NoLMHeadError",
    "OptimizationError",
    "OptimizationResult",
    "OutputCheck",
    "PrecisionError",
    "SignatureError",
    "Tolerance",
    "VerificationReport",
    "VerifiedGraph",
    "available_exporters",
    "export_lm_head",
    "export_onnx",
    "fuse_attention",
    "lm_head_check_batches",
    "optimize_and_verify",
    "optimize_onnx",
    "precision_tolerances",
    "tensorrt_available",
    "verify_onnx",
]
