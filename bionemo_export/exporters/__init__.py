"""Exporting encoder graphs to ONNX (torch.onnx, or Triton Model Navigator when installed) and
verifying them against PyTorch.

    result = export_onnx(model.encoder, model.inputs, model.outputs, sample, out / "model.onnx")
    report = verify_onnx(model.encoder, result.path, batches, atol=family.atol,
                         min_cosine=family.min_cosine)
    report.raise_for_tolerance()
"""

from bionemo_export.exporters.navigator import NavigatorExportError, NavigatorUnavailableError
from bionemo_export.exporters.onnx_export import (
    ExportError,
    ExportResult,
    available_exporters,
    export_onnx,
    tensorrt_available,
)
from bionemo_export.exporters.signature import SignatureError
from bionemo_export.exporters.verification import (
    ExportVerificationError,
    OutputCheck,
    VerificationReport,
    verify_onnx,
)

__all__ = [
    "ExportError",
    "ExportResult",
    "ExportVerificationError",
    "NavigatorExportError",
    "NavigatorUnavailableError",
    "OutputCheck",
    "SignatureError",
    "VerificationReport",
    "available_exporters",
    "export_onnx",
    "tensorrt_available",
    "verify_onnx",
]
