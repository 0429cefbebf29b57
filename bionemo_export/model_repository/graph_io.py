"""What an exported ONNX graph takes and gives, read the way the consistency checks compare it with
a config (consistency.py, and each backend's own rules in backends.py).

`onnx` is imported when a graph is read, not with this module: a base install (no onnx) can import
the planners and the checks, and only checking a repository's graphs needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bionemo_export.tensors import DType


@dataclass(frozen=True)
class GraphIO:
    """An ONNX graph input or output: Triton dtype name and dims (a str for a named dynamic axis,
    None for an unnamed one)."""

    name: str
    dtype: str
    dims: tuple[int | str | None, ...]


def graph_io(path: Path) -> tuple[list[GraphIO], list[GraphIO]]:
    """The graph's inputs (initializers excluded) and outputs after ONNX shape inference; the
    weights (external data included) are not read."""
    import onnx  # only reading a graph needs it (see the module's docstring)

    model = onnx.load(str(path), load_external_data=False)
    model = onnx.shape_inference.infer_shapes(model)
    initializers = {init.name for init in model.graph.initializer}

    def describe(value: Any) -> GraphIO:
        tensor = value.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
        try:
            dtype = DType.from_onnx(tensor.elem_type).value
        except ValueError:  # a type Triton does not serve: reported as a mismatch by the checks
            dtype = f"onnx:{tensor.elem_type}"
        return GraphIO(value.name, dtype, dims)

    inputs = [describe(v) for v in model.graph.input if v.name not in initializers]
    return inputs, [describe(v) for v in model.graph.output]
