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

Importing this package imports none of its modules: each name below loads its module (and with it
torch, onnx or Model Navigator) when first used (PEP 562), so that importing one module of the
package, e.g. `exporters.navigator` to ask whether Navigator is usable, loads no other.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names for type checkers and editors; at run time __getattr__ loads them
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

_MODULE_OF: dict[str, str] = {
    **dict.fromkeys(("LMHeadExport", "NoLMHeadError", "export_lm_head", "lm_head_check_batches"), "lm_head"),
    **dict.fromkeys(("NavigatorExportError", "NavigatorUnavailableError"), "navigator"),
    **dict.fromkeys(("ExportError", "ExportResult", "available_exporters", "export_onnx", "tensorrt_available"),
                    "onnx_export"),
    **dict.fromkeys(("OptimizationError", "OptimizationResult", "PrecisionError", "VerifiedGraph", "fuse_attention",
                     "optimize_and_verify", "optimize_onnx"), "optimize"),
    "SignatureError": "signature",
    **dict.fromkeys(("ExportVerificationError", "OutputCheck", "Tolerance", "VerificationReport",
                     "precision_tolerances", "verify_onnx"), "verification"),
}
"""Each public name -> the module of this package that defines it."""


def __getattr__(name: str) -> Any:
    """A public name, its module imported on first use (submodules themselves Python imports)."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups find it without __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})


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
