"""What an exported ONNX graph takes and gives, read the way the consistency checks compare it with
a config (consistency.py, and each backend's own rules in backends.py).

It also reads where a graph's weights are (`external_references`: the external-data file, offset
and length of each initializer; `initializer_bytes`: what the graph would store alone), which the
checks compare with the files and the build's shared weights file is written from.

`onnx` is imported when a graph is read, not with this module: a base install (no onnx) can import
the planners and the checks, and only checking a repository's graphs needs it.
"""

from __future__ import annotations

from collections.abc import Iterator
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


def initializers(graph: Any) -> Iterator[Any]:
    """Every initializer of `graph` and of its subgraphs (If/Loop bodies)."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.g.ByteSize():
                yield from initializers(attribute.g)
            for subgraph in attribute.graphs:
                yield from initializers(subgraph)


@dataclass(frozen=True)
class ExternalReference:
    """One initializer's external data as a graph file records it."""

    tensor: str
    location: str
    offset: int
    length: int | None


def external_references(graph: Path) -> list[ExternalReference]:
    """Every external-data reference of the graph at `graph` (its weights not read)."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    found = []
    for tensor in initializers(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entries = {entry.key: entry.value for entry in tensor.external_data}
        length = entries.get("length")
        found.append(ExternalReference(tensor.name, entries.get("location", ""), int(entries.get("offset", "0")),
                                       int(length) if length is not None else None))
    return found


def initializer_bytes(graph: Path) -> int:
    """The bytes of every initializer of the graph at `graph`, inline or external: what the graph
    would store alone (a tensor it references twice counted once)."""
    import onnx

    seen: set[tuple[str, int]] = set()
    total = 0

    model = onnx.load(str(graph), load_external_data=False)
    for tensor in initializers(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            entries = {entry.key: entry.value for entry in tensor.external_data}
            where = (entries.get("location", ""), int(entries.get("offset", "0")))
            if where in seen:
                continue
            seen.add(where)
            total += int(entries.get("length", "0"))
        else:
            total += len(tensor.raw_data) if tensor.HasField("raw_data") else tensor.ByteSize()
    return total


def repository_weight_bytes(root: Path) -> int:
    """The weight bytes a repository stores: every graph's inline initializers, and every
    external-data file its graphs reference, each file once (a shared weights file counts once
    however many graphs use it)."""
    import onnx

    total = 0
    data_files: set[Path] = set()
    for graph in sorted(Path(root).rglob("*.onnx")):
        model = onnx.load(str(graph), load_external_data=False)
        for tensor in initializers(model.graph):
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                location = next(entry.value for entry in tensor.external_data if entry.key == "location")
                data_files.add((graph.parent / location).resolve())
            else:
                total += len(tensor.raw_data) if tensor.HasField("raw_data") else tensor.ByteSize()
    return total + sum(path.stat().st_size for path in data_files if path.is_file())
