"""Several ONNX graphs over one copy of their weights: one external-data file that every graph of a
model folder references, each distinct tensor stored once.

Why: the layers, contacts and attentions graphs are the encoder again (its weights, other
outputs, eager attention where probabilities are answered). Stored separately, a repository holds
the encoder's weights once per graph, and every served process loads each copy. Written here,
their initializers are deduplicated by content into `weights.bin`: a tensor that several graphs
hold (byte for byte the same, which the exporter gives every graph of one PyTorch module) is
written once and every graph points at it (its `location`, `offset` and `length`).

What ONNX Runtime does with such a file (measured with 1.32 on CPU, recorded in
benchmarks/results/shared_weights.json): it memory-maps external data (whatever the offset's
alignment) instead of reading it, so a session whose weights are not prepacked computes from the
page cache's pages: every session and every process on the host that opens the file shares them
(Pss_File), and none holds a private copy. Prepacking (ONNX Runtime's default) copies each MatMul
weight into a packed private buffer per session and drops the mapped pages; serving/onnx_session.py
says which sessions prepack. ONNX Runtime refuses an external-data path that leaves the graph's
folder (`..`, absolute paths, symlinks resolving elsewhere), so the file sits beside the graphs
that use it, in one model's version folder.

Tensors are read and written one at a time: the build's memory holds one tensor's bytes (and a
graph's inline ones), never a graph's weights.
Tensors under SMALL_TENSOR_BYTES (shapes, scalars, the tiny constants exporters add) stay inline.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from bionemo_export.model_repository.graph_io import (
    ExternalReference,
    external_references,
    initializer_bytes,
    initializers,
)

__all__ = ["ExternalReference", "SharedWeights", "SharedWeightsWriter", "external_references", "initializer_bytes",
           "share_weights"]

WEIGHTS_FILE = "weights.bin"
"""The shared external-data file's name, in the folder of the graphs that use it."""
SMALL_TENSOR_BYTES = 1024
"""Initializers of fewer bytes stay inside their graph: their sharing saves nothing."""
ALIGNMENT = 64
"""Each tensor starts at a multiple of this many bytes (SIMD loads of a mapped tensor are aligned;
ONNX Runtime maps the file whatever the offset, measured)."""


@dataclass
class SharedWeights:
    """What `share_weights` wrote: the graphs, the weights file and what the sharing saved."""

    weights: Path
    graphs: dict[str, Path]
    """Each input graph's name -> its rewritten graph file (beside `weights`)."""
    stored_bytes: int = 0
    """The weights file's size."""
    referenced_bytes: int = 0
    """The external initializers' bytes summed over the graphs: what separate graphs would store."""
    inline_bytes: dict[str, int] = field(default_factory=dict)
    """Per graph, the initializer bytes left inside it (small tensors)."""
    tensors: int = 0
    """Distinct tensors in the weights file."""

    def record(self) -> dict:
        """manifest.json's `shared_weights`: the file and what the sharing saved."""
        return {"file": self.weights.name, "bytes": self.stored_bytes, "tensors": self.tensors,
                "graphs": {name: path.name for name, path in self.graphs.items()},
                "bytes_without_sharing": self.referenced_bytes,
                "inline_bytes": dict(self.inline_bytes)}


def _raw(tensor, folder: Path) -> bytes | None:
    """The tensor's bytes: read from its external-data file (only this tensor's range) or its
    raw_data; None where the exporter used typed fields (left inline)."""
    import onnx

    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        entries = {entry.key: entry.value for entry in tensor.external_data}
        with open(folder / entries["location"], "rb") as data:
            data.seek(int(entries.get("offset", "0")))
            length = entries.get("length")
            return data.read(int(length)) if length is not None else data.read()
    return tensor.raw_data if tensor.HasField("raw_data") else None


class SharedWeightsWriter:
    """One weights file that graphs are written over as they come: `add` appends the tensors the
    file does not hold yet and writes the graph pointing at them, so a build can drop each graph's
    own external data as soon as the graph is rewritten (the disk then holds the shared file and
    one graph's data at a time, not every graph's: ESM-2 3B's four graphs are 45 GB apart).

        with SharedWeightsWriter(folder) as writer:
            writer.add("encoder", exported_encoder, "model.onnx")
            writer.add("layers", exported_layers, "layers.onnx")
        writer.result                         # SharedWeights: the file, the graphs, what was saved
    """

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.result = SharedWeights(folder / WEIGHTS_FILE, {})
        self._offsets: dict[bytes, tuple[int, int]] = {}  # digest -> (offset, length)
        self._out = open(self.result.weights, "wb")

    def __enter__(self) -> SharedWeightsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def add(self, name: str, source: Path, file_name: str) -> Path:
        """Write graph `source` (its external data beside it, if any) as `file_name` beside the
        weights file, its initializers of SMALL_TENSOR_BYTES or more in that file, each distinct
        (data type, bytes) once; the written graph's path. The weights file is flushed: a session
        may open the graph at once. `source` must not be in the weights file's folder."""
        import onnx  # the build's dependency; the module imports without it

        out, result = self._out, self.result
        # The graph without its external data: each tensor's bytes are read when it is written.
        model = onnx.load(str(source), load_external_data=False)
        inline = 0
        for tensor in initializers(model.graph):
            raw = _raw(tensor, Path(source).parent)
            if raw is None or len(raw) < SMALL_TENSOR_BYTES:
                inline += len(raw) if raw is not None else tensor.ByteSize()
                continue
            key = hashlib.sha256(tensor.data_type.to_bytes(4, "little") + raw).digest()
            if key not in self._offsets:
                out.write(b"\0" * (-out.tell() % ALIGNMENT))
                self._offsets[key] = (out.tell(), len(raw))
                out.write(raw)
                result.tensors += 1
            result.referenced_bytes += len(raw)
            offset, length = self._offsets[key]
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
            del tensor.external_data[:]
            for key_name, value in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(length))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key_name, value
        out.flush()
        result.stored_bytes = out.tell()
        destination = result.weights.parent / file_name
        onnx.save_model(model, str(destination))
        result.graphs[name] = destination
        result.inline_bytes[name] = inline
        return destination

    def close(self) -> SharedWeights:
        """Close the weights file; what was written."""
        if not self._out.closed:
            self.result.stored_bytes = self._out.tell()
            self._out.close()
        return self.result


def share_weights(graphs: dict[str, Path], folder: Path, files: dict[str, str]) -> SharedWeights:
    """Write every graph of `graphs` (name -> .onnx path, its external data beside it if any) into
    `folder` as `files[name]` over one `folder`/WEIGHTS_FILE (`SharedWeightsWriter.add`, in the
    order given). `folder` must not hold the inputs: the graphs are read from where they are and
    written anew."""
    with SharedWeightsWriter(folder) as writer:
        for name, source in graphs.items():
            writer.add(name, source, files[name])
    return writer.result


def describe(shared: SharedWeights) -> str:
    """One line for the build's progress."""
    return (f"{len(shared.graphs)} graphs share {shared.weights.name}: {shared.stored_bytes / 1e6:.1f} MB "
            f"({shared.tensors} tensors) instead of {shared.referenced_bytes / 1e6:.1f} MB")
