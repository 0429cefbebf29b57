"""Graphs whose weights stay on disk while the graph is rewritten: loaded without their external
data, written with it copied chunk by chunk (exporters/optimize/candidates.py for graphs over
EXTERNAL_DATA_THRESHOLD_BYTES).

A graph of ESM-2 3B's size holds 11 GB of weights; its fusions only rewrite nodes and add small
constants. Loading it whole (onnx.load) and saving it (onnx.save_model) each hold every weight in
the process, besides the PyTorch model and ONNX Runtime's copy. Here the weights are never read
into the process:

    model = load_structure(src)                 # nodes, small constants; weights as references
    ...rewrite model.graph...
    save_streamed(model, dst, source_dir=src.parent)

`save_streamed` copies each referenced weight from the file it lives in, and writes each weight
held in the proto (`raw_data`, such as a fused node's new constant), into `<dst>.data`, one chunk
at a time; the graph file keeps the references.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import onnx
from onnx import TensorProto
from onnx.external_data_helper import ExternalDataInfo, load_external_data_for_tensor, uses_external_data

SMALL_TENSOR_BYTES = 1 << 20
"""Tensors up to this size are read into the proto by `load_structure` (the constants fusions read:
scales, shapes, masks); larger ones stay references."""
CHUNK_BYTES = 64 << 20
"""Bytes copied at once by `save_streamed`."""
ALIGNMENT = 4096
"""Each weight starts at a multiple of this in the data file, so ONNX Runtime can map it in place."""
MIN_EXTERNAL_BYTES = 1024
"""Tensors from this size up go to the data file (onnx's own `size_threshold` default)."""


def tensors(model: onnx.ModelProto) -> Iterator[TensorProto]:
    """Every initializer of the graph and its subgraphs, and every tensor a Constant-like node holds."""
    def walk(graph: onnx.GraphProto) -> Iterator[TensorProto]:
        yield from graph.initializer
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.HasField("t"):
                    yield attribute.t
                yield from attribute.tensors
                if attribute.HasField("g"):
                    yield from walk(attribute.g)
                for subgraph in attribute.graphs:
                    yield from walk(subgraph)
    return walk(model.graph)


def tensor_bytes(tensor: TensorProto) -> int:
    """A tensor's data size, whether held in the proto or referenced in an external file."""
    if uses_external_data(tensor):
        length = ExternalDataInfo(tensor).length
        if length:
            return int(length)
        count = 1
        for size in tensor.dims:
            count *= size
        return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    return onnx.numpy_helper.to_array(tensor).nbytes


def unloaded(tensor: TensorProto) -> bool:
    """Whether `tensor`'s data is a reference to a file, not held in the proto."""
    return uses_external_data(tensor) and not tensor.HasField("raw_data")


def load_structure(src: Path) -> onnx.ModelProto:
    """The graph at `src` with the tensors up to SMALL_TENSOR_BYTES read in and larger ones left
    as references into their file (relative to `src`'s folder)."""
    model = onnx.load(str(src), load_external_data=False)
    for tensor in tensors(model):
        if unloaded(tensor) and tensor_bytes(tensor) <= SMALL_TENSOR_BYTES:
            load_external_data_for_tensor(tensor, str(Path(src).parent))
            tensor.data_location = TensorProto.DEFAULT
            del tensor.external_data[:]
    return model


def load_weights(model: onnx.ModelProto, source_dir: Path) -> None:
    """Read every tensor `model` still references into the proto (what a quantizer needs)."""
    for tensor in tensors(model):
        if unloaded(tensor):
            load_external_data_for_tensor(tensor, str(source_dir))
            tensor.data_location = TensorProto.DEFAULT
            del tensor.external_data[:]


class DataFileWriter:
    """Appends tensors' bytes to one external data file, each at a multiple of ALIGNMENT, and points
    each tensor at its bytes: what `save_streamed` and the streamed export (exporters/streamed.py)
    write their weights with."""

    def __init__(self, out: BinaryIO, location: str) -> None:
        self.out, self.location, self.written = out, location, 0

    def append(self, tensor: TensorProto, chunks: Iterable[Any]) -> None:
        """Write `chunks` (the tensor's bytes, in order: bytes, or arrays of uint8) and refer
        `tensor` to them."""
        offset = -(-self.written // ALIGNMENT) * ALIGNMENT
        self.out.seek(offset)
        size = 0
        for chunk in chunks:
            self.out.write(chunk)
            size += len(chunk)
        _refer(tensor, self.location, offset, size)
        self.written = offset + size


def save_streamed(model: onnx.ModelProto, path: Path, *, source_dir: Path) -> int:
    """Write `model` to `path`, every tensor of MIN_EXTERNAL_BYTES or more in `<path>.data`: those
    it references (files relative to `source_dir`) copied CHUNK_BYTES at a time, those it holds
    moved out of the proto. `model`'s references then name the new file. Returns the data bytes."""
    path = Path(path)
    data_path = path.with_name(path.name + ".data")
    sources: dict[Path, int] = {}
    try:
        with data_path.open("wb") as out:
            writer = DataFileWriter(out, data_path.name)
            for tensor in tensors(model):
                if unloaded(tensor):
                    info = ExternalDataInfo(tensor)
                    source = (Path(source_dir) / info.location).resolve()
                    if source not in sources:
                        sources[source] = os.open(source, os.O_RDONLY)
                    writer.append(tensor, _chunks(sources[source], int(info.offset or 0), tensor_bytes(tensor)))
                elif tensor.HasField("raw_data") and len(tensor.raw_data) >= MIN_EXTERNAL_BYTES:
                    data = tensor.raw_data
                    tensor.ClearField("raw_data")
                    writer.append(tensor, [data])
    finally:
        for descriptor in sources.values():
            os.close(descriptor)
    onnx.save_model(model, str(path))
    data_path.chmod(path.stat().st_mode & 0o777)  # as the graph: a server running as another user reads both
    return writer.written


def _chunks(source: int, offset: int, size: int) -> Iterator[bytes]:
    """`size` bytes of the file `source` from `offset`, CHUNK_BYTES at a time."""
    while size:
        chunk = os.pread(source, min(size, CHUNK_BYTES), offset)
        if not chunk:
            raise OSError(f"external data ends {size} bytes early")
        yield chunk
        offset += len(chunk)
        size -= len(chunk)


def _refer(tensor: TensorProto, location: str, offset: int, length: int) -> None:
    """Point `tensor` at `length` bytes of `location` from `offset`."""
    tensor.data_location = TensorProto.EXTERNAL
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
