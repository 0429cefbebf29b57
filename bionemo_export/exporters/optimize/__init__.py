"""Optimize exported graphs for ONNX Runtime once, at build time, and store them optimized.

    result = optimize_onnx(src, dst, num_heads=8, hidden_size=512)                    # fp32
    result = optimize_onnx(src, dst, num_heads=8, hidden_size=512, precision="int8")  # CPU int8
    chosen = optimize_and_verify(module, plain, report, work, batches, ...)           # what a build stores

One module per job:

- `pipeline.py`: `optimize_and_verify`, what the build calls: candidates made in order, each
  checked against PyTorch, the first that passes kept (fp32 falls back to the plain export; int8
  and fp16 fail with the figures), and the record of that choice for manifest.json.
- `candidates.py`: `optimize_onnx`, one candidate graph: attention fusion, ONNX Runtime's
  transformer fusions, reduced precision, ONNX Runtime's offline optimization, written to a file.
- `attention.py`: `fuse_attention`, each attention subgraph as one MultiHeadAttention node.
- `quantization.py`: int8 (dynamic quantization, for CPUs) and fp16 (for GPU hosts).
- `weight_only.py`: int8w and int4 (weight-only blockwise quantization, ONNX Runtime's
  MatMulNBits, for CPUs).
- `graph.py`: the graph view the rewrites share.

The session level a server opens a stored graph at is named in serving/parameters.py.
"""

from bionemo_export.serving.parameters import SERVING_GRAPH_OPTIMIZATION_LEVEL, UNOPTIMIZED_SERVING_LEVEL

from .attention import MASK_FILL_LIMIT, MS_DOMAIN, fuse_attention
from .candidates import (
    DEFAULT_LEVEL,
    DISABLED_RUNTIME_FUSIONS,
    FUSED_OPERATORS,
    FusedGraph,
    OptimizationError,
    OptimizationResult,
    fuse_graph,
    fused_operators,
    optimize_onnx,
)
from .pipeline import (
    ATTEMPTS,
    CandidateFigures,
    FusedGraphs,
    Int8Graphs,
    OptimizationRecord,
    PrecisionError,
    RejectedCandidate,
    VerifiedGraph,
    optimize_and_verify,
    verified_int8_graphs,
)
from .quantization import FP16_METHOD, INT8_METHOD, Fp16Conversion, Int8Quantization
from .weight_only import WeightOnlyQuantization, quantize_weight_only

__all__ = [
    "ATTEMPTS",
    "DEFAULT_LEVEL",
    "DISABLED_RUNTIME_FUSIONS",
    "FP16_METHOD",
    "FUSED_OPERATORS",
    "INT8_METHOD",
    "MASK_FILL_LIMIT",
    "MS_DOMAIN",
    "SERVING_GRAPH_OPTIMIZATION_LEVEL",
    "UNOPTIMIZED_SERVING_LEVEL",
    "CandidateFigures",
    "FusedGraph",
    "FusedGraphs",
    "Int8Graphs",
    "Fp16Conversion",
    "Int8Quantization",
    "OptimizationError",
    "OptimizationRecord",
    "OptimizationResult",
    "PrecisionError",
    "RejectedCandidate",
    "VerifiedGraph",
    "WeightOnlyQuantization",
    "fuse_attention",
    "fuse_graph",
    "fused_operators",
    "optimize_and_verify",
    "optimize_onnx",
    "quantize_weight_only",
    "verified_int8_graphs",
]
