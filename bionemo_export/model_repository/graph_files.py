"""How a stored ONNX graph is opened when served: the ONNX Runtime session level for each kind of graph.

The exporters decide which kind a build stores (exporters/optimize: an offline-optimized graph or
the plain export); the planners write the matching level into the model's `config.pbtxt`
(`graph_optimization_level`). Both read these names from here, so that the planners need not
import the exporters.
"""

from __future__ import annotations

SERVING_GRAPH_OPTIMIZATION_LEVEL = "ORT_ENABLE_BASIC"
"""The ONNX Runtime session level for a graph stored optimized offline (fp32, int8): the expensive
rewrites are already in the file, and "all" measured no faster."""
UNOPTIMIZED_SERVING_LEVEL = "ORT_ENABLE_ALL"
"""The session level for a graph stored without offline optimization (the plain export, fp16)."""
