"""The bridge between `TensorSpec`s and ONNX graphs: dtypes, dynamic axes, sample arguments, and
the check that an exported graph has exactly the declared inputs and outputs.

Every exporter (torch.onnx, Model Navigator) uses these, so they all agree on what a graph's
signature must be.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import torch

from bionemo_export.errors import UserError
from bionemo_export.tensors import TensorSpec


class SignatureError(UserError, ValueError):
    """Sample inputs or an exported graph do not match the declared TensorSpecs."""


def dynamic_axes(specs: Sequence[TensorSpec]) -> dict[str, dict[int, str]]:
    """`{tensor: {axis index: axis name}}` for every dynamic (str) axis: torch.onnx's
    `dynamic_axes` format, which Model Navigator's OnnxConfig takes too."""
    return {
        spec.name: {i: axis for i, axis in enumerate(spec.dims) if isinstance(axis, str)}
        for spec in specs
    }


def sample_arguments(
    inputs: Sequence[TensorSpec], sample_inputs: Mapping[str, np.ndarray]
) -> tuple[torch.Tensor, ...]:
    """The sample batch as positional tensors in the order of `inputs` (the module's forward
    order), after checking that every input is present with its declared dtype and rank."""
    missing = [spec.name for spec in inputs if spec.name not in sample_inputs]
    if missing:
        raise SignatureError(
            f"sample_inputs lacks {missing}; it must hold one array per input: "
            f"{[spec.name for spec in inputs]}"
        )
    arguments = []
    for spec in inputs:
        array = np.asarray(sample_inputs[spec.name])
        expected = onnx.helper.tensor_dtype_to_np_dtype(spec.dtype.onnx)
        if array.dtype != expected or array.ndim != len(spec.dims):
            raise SignatureError(
                f"sample input {spec.name!r} is {array.dtype} with shape {array.shape}; "
                f"expected {expected} with {len(spec.dims)} axes {spec.dims}"
            )
        arguments.append(torch.from_numpy(np.ascontiguousarray(array)))
    return tuple(arguments)


def check_graph_signature(
    onnx_path: Path, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
) -> None:
    """Raise SignatureError unless the graph's inputs and outputs are exactly `inputs` and
    `outputs`: same names in the same order, same element types, dynamic axes symbolic and
    fixed axes equal. Clients and Triton configs are written from the specs, so any drift
    (a renamed tensor, a bool input turned into int, a baked-in length) must stop the build."""
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    problems = _compare("input", graph.input, inputs) + _compare("output", graph.output, outputs)
    if problems:
        raise SignatureError(f"{onnx_path} does not match the declared tensors: " + "; ".join(problems))


def _compare(
    kind: str, values: Sequence[onnx.ValueInfoProto], specs: Sequence[TensorSpec]
) -> list[str]:
    """Human-readable differences between graph values and specs (empty when they match)."""
    names = [value.name for value in values]
    if names != [spec.name for spec in specs]:
        return [f"{kind}s are {names}, expected {[spec.name for spec in specs]}"]
    problems = []
    for value, spec in zip(values, specs):
        tensor_type = value.type.tensor_type
        if tensor_type.elem_type != spec.dtype.onnx:
            got = onnx.TensorProto.DataType.Name(tensor_type.elem_type)
            problems.append(f"{kind} {spec.name!r} has element type {got}, expected {spec.dtype}")
        dims = [dim.dim_param or (dim.dim_value if dim.HasField("dim_value") else "?")
                for dim in tensor_type.shape.dim]
        if len(dims) != len(spec.dims):
            problems.append(f"{kind} {spec.name!r} has shape {dims}, expected {list(spec.dims)}")
            continue
        for index, (dim, axis) in enumerate(zip(dims, spec.dims)):
            dynamic_ok = isinstance(axis, str) and isinstance(dim, str)
            if not (dynamic_ok or dim == axis):
                problems.append(
                    f"{kind} {spec.name!r} axis {index} is {dim!r}, expected {axis!r} "
                    f"({'dynamic' if isinstance(axis, str) else 'fixed'})"
                )
    return problems
