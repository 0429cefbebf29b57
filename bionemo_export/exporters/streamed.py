"""A quantized graph written one weight at a time: the build path of checkpoints whose fp32 weights
do not fit in the host's memory (ESM C 6B, ESM-2 15B) in `int8w` or `int4`.

    graph = export_streamed(module, inputs, outputs, batch, out / "model.onnx", precision="int4")
    graph.export.path, graph.result      # the written graph, its manifest record (precision, quantization)

The other build paths export an fp32 graph, check it in ONNX Runtime (whose session holds a
prepacked copy of every weight), fuse it, then quantize it: each step needs the fp32 weights once
more, in memory or on disk (ESM C 6B: 25 GB each time, on a 24 GB host). Here:

1. torch.onnx exports the module's structure without constant folding: every weight stays the
   module's own tensor (pages of the mapped checkpoint) and the linear layers stay
   `MatMul(x, Transpose(W))`; the graph is saved without its weights, each one an input named by
   its parameter.
2. Each weight is then read from the module and written into the graph's one data file: the
   weight of every such MatMul quantized into `MatMulNBits` by the quantizer of the other paths
   (optimize/weight_only.quantize_linear, whose bytes for a weight are those a whole graph's
   quantization gives it), every other weight (embeddings, norms, rotary tables) as it is. One fp32
   weight is in memory at a time; no fp32 copy is written anywhere.
3. The build checks the written graph against the PyTorch module in the sessions its served model
   opens (optimize/pipeline.verify_streamed): the first ONNX Runtime session of the build is the
   quantized graph's, 0.19x (int4) of the fp32 weights.

What it leaves out, against the other paths: the attention and transformer fusions (ONNX Runtime's
own session optimizations still run when the served model opens the graph), and the candidate
ladder that keeps some products at more bits: the graph is quantized once, every product alike.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from bionemo_export.choices import Exporter, OptimizationLevel, Precision
from bionemo_export.exporters.external_data import DataFileWriter
from bionemo_export.exporters.onnx_export import (
    DEFAULT_OPSET,
    ExportResult,
    check_written,
    collected_warnings,
    eval_mode,
    torch_program,
)
from bionemo_export.exporters.optimize.candidates import OptimizationResult
from bionemo_export.exporters.optimize.weight_only import (
    DEFAULT_ACCURACY_LEVEL,
    DEFAULT_BLOCK_SIZE,
    METHOD,
    WeightOnlyQuantization,
    check_settings,
    quantize_linear,
)
from bionemo_export.exporters.signature import sample_arguments
from bionemo_export.models.readers.mapped import deferred_widening_paused, widened_while_used
from bionemo_export.serving.parameters import UNOPTIMIZED_SERVING_LEVEL
from bionemo_export.tensors import TensorSpec

STREAMED_STEP = "streamed weight-only quantization"
"""The step a streamed graph's manifest record names (OptimizationResult.applied)."""
NOT_FUSED = ("fusions: a streamed graph is the export as it is (ONNX Runtime's session optimizations run when "
             "the served model opens it)")


@dataclass(frozen=True)
class StreamedGraph:
    """What `export_streamed` wrote: the export's record and the graph's optimization record."""

    export: ExportResult
    result: OptimizationResult
    quantization: WeightOnlyQuantization
    """`result.quantization`, typed."""


def export_streamed(module: torch.nn.Module, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                    sample_inputs: Mapping[str, np.ndarray], out_path: Path, *, precision: Precision | str,
                    block_size: int = DEFAULT_BLOCK_SIZE, accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
                    opset: int = DEFAULT_OPSET) -> StreamedGraph:
    """Export `module` (as onnx_export.export_onnx takes it) to `out_path` in `precision` ("int8w" or
    "int4"), its weights written one at a time into `<out_path>.data` (the module's docstring)."""
    precision = Precision.parse(precision, "precision")
    bits = check_settings(precision, block_size, accuracy_level)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    structure = out_path.with_name(out_path.name + ".structure")
    parameters = dict(module.named_parameters())
    with eval_mode(module), collected_warnings() as caught, deferred_widening_paused():
        program = torch_program(module, inputs, outputs, sample_arguments(inputs, sample_inputs), opset, fold=False)
        # A parameter is read from the module itself: one whose widening is deferred holds its
        # values only while it is read (models/readers/mapped.widened_while_used).
        weights = {name: parameters.get(name, value.const_value)
                   for name, value in program.model.graph.initializers.items()}
        program.save(str(structure), include_initializers=False, keep_initializers_as_inputs=True)
    del program
    model = onnx.load(str(structure))
    structure.unlink()
    nodes_before = len(model.graph.node)
    quantization = write_weights(model, weights, out_path, bits=bits, block_size=block_size,
                                 accuracy_level=accuracy_level)
    check_written(out_path, inputs, outputs)
    seconds = round(time.perf_counter() - start, 3)
    data_path = out_path.with_name(out_path.name + ".data")
    versions = {"torch": torch.__version__, "onnx": onnx.__version__}
    onnx_bytes, data_bytes = out_path.stat().st_size, data_path.stat().st_size
    parameters = sum(p.numel() for p in module.parameters())
    export = ExportResult(path=out_path, exporter=Exporter.TORCH, torch_exporter="dynamo (streamed)", opset=opset,
                          external_data=True, data_path=data_path, onnx_bytes=onnx_bytes,
                          data_bytes=data_bytes, parameters=parameters,
                          weight_bytes=quantization.weight_bytes_fp32, seconds=seconds, versions=versions,
                          warnings=tuple(caught))
    result = OptimizationResult(path=out_path, precision=precision, level=OptimizationLevel.NONE,
                                applied=(STREAMED_STEP,),
                                fused={"MatMulNBits": quantization.matmuls_quantized}, skipped=(NOT_FUSED,),
                                nodes_before=nodes_before, nodes_after=len(model.graph.node),  # as written
                                external_data=True, bytes=onnx_bytes + data_bytes, seconds=seconds, versions=versions,
                                serving_graph_optimization_level=UNOPTIMIZED_SERVING_LEVEL,
                                quantization=quantization)
    return StreamedGraph(export, result, quantization)


def write_weights(model: onnx.ModelProto, weights: Mapping[str, Any], path: Path, *, bits: int, block_size: int,
                  accuracy_level: int) -> WeightOnlyQuantization:
    """Write `model` (its weights graph inputs named as in `weights`: name -> an array-like with
    `.numpy()`, the exporter's tensors) to `path` with every weight an initializer in
    `<path>.data`, the linear layers' quantized into MatMulNBits of `bits`, one weight in memory
    at a time; how it was quantized. A weight that is a torch tensor is read inside
    `widened_while_used` (a deferred one holds its values only there)."""
    graph = model.graph
    names = [value.name for value in graph.input if value.name in weights]
    users: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            users[name].append(node)
    replaced: dict[int, onnx.NodeProto | None] = {}  # id(node) -> its replacement (None: removed)
    quantized = left = 0
    fp32_bytes = stored = 0
    data_path = path.with_name(path.name + ".data")
    with data_path.open("wb") as out:
        writer = DataFileWriter(out, data_path.name)
        for name in names:
            source = weights[name]
            with widened_while_used([source] if isinstance(source, torch.Tensor) else []):
                array = np.asarray(source.detach().numpy() if isinstance(source, torch.Tensor) else source.numpy())
                linear = _linear_matmuls(name, array, users)
                if linear is None:
                    tensor = _tensor(name, array)
                    writer.append(tensor, [np.ascontiguousarray(array).reshape(-1).view(np.uint8)])
                    graph.initializer.append(tensor)
                    left += sum(node.op_type == "Transpose" and bool(_matmul_users(node, users))
                                for node in users[name])
                    continue
                node, initializers = quantize_linear(name, array.astype(np.float32, copy=False), bits, block_size,
                                                     accuracy_level)
            transpose, matmuls = linear
            for initializer in initializers:
                data = initializer.raw_data
                initializer.ClearField("raw_data")
                writer.append(initializer, [data])
                graph.initializer.append(initializer)
                stored += len(data)
            fp32_bytes += array.size * 4
            replaced[id(transpose)] = None
            for index, matmul in enumerate(matmuls):
                replacement = onnx.NodeProto()
                replacement.CopyFrom(node)
                replacement.input[0] = matmul.input[0]
                replacement.output[:] = matmul.output
                replacement.name = matmul.name or f"{name}_MatMulNBits{index or ''}"
                replaced[id(matmul)] = replacement
                quantized += 1
    nodes = [replaced.get(id(node), node) for node in graph.node]
    del graph.node[:]
    graph.node.extend(node for node in nodes if node is not None)
    kept_inputs = [value for value in graph.input if value.name not in weights]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    if quantized and not any(opset.domain == "com.microsoft" for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save_model(model, str(path))
    data_path.chmod(path.stat().st_mode & 0o777)  # as the graph: a server running as another user reads both
    return WeightOnlyQuantization(
        method=METHOD.format(bits=bits, block_size=block_size, accuracy_level=accuracy_level)
        + "; streamed: one weight at a time from the checkpoint", bits=bits, block_size=block_size,
        accuracy_level=accuracy_level, keep_share=0.0, kept=[], kept_as="8 bits" if bits == 4 else "fp32",
        matmuls_quantized=quantized, matmuls_fp32=left, weight_bytes_fp32=fp32_bytes, weight_bytes=stored)


def _linear_matmuls(name: str, array: np.ndarray, users: Mapping[str, list[onnx.NodeProto]]
                    ) -> tuple[onnx.NodeProto, list[onnx.NodeProto]] | None:
    """The exporter's linear layer over weight `name`: its one Transpose (perm 1, 0) and the MatMuls
    that take the transpose as their second input; None for any other use of the weight."""
    if array.ndim != 2 or array.dtype not in (np.float32, np.float16) or len(users[name]) != 1:
        return None
    (transpose,) = users[name]
    perm = next((list(attribute.ints) for attribute in transpose.attribute if attribute.name == "perm"), None)
    if transpose.op_type != "Transpose" or perm != [1, 0]:
        return None
    matmuls = _matmul_users(transpose, users)
    return (transpose, matmuls) if matmuls and len(matmuls) == len(users[transpose.output[0]]) else None


def _matmul_users(transpose: onnx.NodeProto, users: Mapping[str, list[onnx.NodeProto]]) -> list[onnx.NodeProto]:
    """The MatMuls taking `transpose`'s output as their weights (second input)."""
    return [node for node in users[transpose.output[0]]
            if node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] == transpose.output[0]]


def _tensor(name: str, array: np.ndarray) -> TensorProto:
    """An initializer named `name` of `array`'s type and shape, its data still to be written."""
    tensor = TensorProto()
    tensor.name = name
    tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
    tensor.dims.extend(array.shape)
    return tensor
