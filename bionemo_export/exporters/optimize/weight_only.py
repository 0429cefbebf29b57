"""Weight-only quantization for CPU hosts: `int8w` and `int4` (ONNX Runtime's MatMulNBits).

    model, record = quantize_weight_only(model, "int4", block_size=32, accuracy_level=4)

Every MatMul with constant weights becomes a `com.microsoft.MatMulNBits` node: its weights are
stored in 8 (int8w) or 4 (int4) bits, in blocks of `block_size` values along the reduction axis K,
each block with its own fp32 scale and zero point (asymmetric, round to nearest:
`onnxruntime.quantization.matmul_nbits_quantizer`, its DEFAULT algorithm). llama.cpp's Q8_0 and
Q4_0 are the same idea with blocks of 32. What is left in fp32: the token embedding (a Gather,
tens of rows by the width: under 0.1% of any protein model's weights, and every answer starts
from it), the layer norms, biases and the attention's own products, and the graphs other than the
encoder's (the masked-LM and fine-tuned heads, a vocabulary-by-width product run once per
position: small, and their log-probabilities are what scoring ranks).

`accuracy_level` is the MatMulNBits attribute that lets the CPU kernel quantize the activations
too, per block of K, to int8 (4), and sum the products in integers; 0 leaves the kernel its
default (fp32 activations: weights dequantized block by block). Level 4 is what VNNI and AMX CPUs
compute fast, and it keeps the real AntiBERTy within int8w's and int4's tolerances with their
margin; on the AVX2-only kind (no 8-bit dot products that sum in 32 bits) level 0 measured as
accurate and faster (docs/building.md, benchmarks/weight_only.py). The build checks every graph
against PyTorch with a margin (pipeline.py) whatever the level.

`keep_share` names the most sensitive products (the feed-forward output MatMuls, fed by a GELU
or a SwiGLU: `quantization.ffn_outputs_by_error`, last layers first) that a candidate keeps at a
higher precision: fp32 for int8w, 8 bits for int4 (llama.cpp's Q4_K_M keeps some tensors at more
bits the same way). The candidates of a build try none, then more (pipeline.ATTEMPTS).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.external_data_helper import load_external_data_for_tensor

from bionemo_export.choices import DEFAULT_WEIGHT_BLOCK_SIZE, WEIGHT_BLOCK_SIZES
from bionemo_export.exporters.external_data import unloaded

from .quantization import ffn_outputs_by_error

WEIGHT_ONLY_BITS: dict[str, int] = {"int8w": 8, "int4": 4}
"""The weight-only precisions and their bits per weight."""
DEFAULT_BLOCK_SIZE = DEFAULT_WEIGHT_BLOCK_SIZE
"""Values per quantization block along K. 32 (llama.cpp's Q8_0/Q4_0 block) measured on the real
AntiBERTy: the closest to fp32 of 32, 64 and 128 at both 8 and 4 bits (docs/building.md), at
0.5 byte of scales and zero points per 32 weights."""
BLOCK_SIZES = WEIGHT_BLOCK_SIZES
"""The block sizes MatMulNBits computes (powers of two from 16)."""
DEFAULT_ACCURACY_LEVEL = 4
"""MatMulNBits' accuracy_level: 4, int8 activations per block (the module's docstring)."""
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
"""0: the kernel's default (fp32 activations); 1-3: fp32, fp16, bf16 activations; 4: int8."""
METHOD = ("onnxruntime.quantization.matmul_nbits_quantizer: MatMulNBits, {bits}-bit weights in blocks of "
          "{block_size} along K, asymmetric (scale and zero point per block), round to nearest; accuracy_level "
          "{accuracy_level}")
LOG = logging.getLogger(__name__)
NodeQuantizer = Callable[[onnx.NodeProto, list[onnx.GraphProto]], list[onnx.NodeProto]]
"""onnxruntime's per-node quantization step: a node and its graph stack -> the nodes replacing it."""


@dataclass(frozen=True)
class WeightOnlyQuantization:
    """How an int8w or int4 graph was quantized (manifest.json's `optimization.quantization`)."""

    method: str
    bits: int
    block_size: int
    accuracy_level: int
    keep_share: float
    """The share of the feed-forward output MatMuls asked to stay at `kept_as`."""
    kept: list[str]
    """The MatMul nodes kept at `kept_as`, in the order they were chosen."""
    kept_as: str
    """"fp32" (int8w) or "8 bits" (int4)."""
    matmuls_quantized: int
    """MatMulNBits nodes in the graph (kept 8-bit ones of an int4 graph included)."""
    matmuls_fp32: int
    """MatMuls with constant weights left in fp32."""
    weight_bytes_fp32: int
    """The quantized MatMuls' weights as they were (fp32)."""
    weight_bytes: int
    """The same weights as stored: packed integers, scales and zero points."""

    @property
    def ratio(self) -> float:
        """weight_bytes / weight_bytes_fp32: 0.28 (8 bits) and 0.16 (4 bits) at block size 32."""
        return self.weight_bytes / self.weight_bytes_fp32 if self.weight_bytes_fp32 else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ratio": round(self.ratio, 4)}


def check_settings(precision: str, block_size: int, accuracy_level: int) -> int:
    """The bits of `precision`; ValueError naming the setting and its choices when one is not
    a weight-only precision, a block size MatMulNBits computes or an accuracy level."""
    if precision not in WEIGHT_ONLY_BITS:
        raise ValueError(f"`precision` '{precision}' is not weight-only: choose one of {', '.join(WEIGHT_ONLY_BITS)}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"`block_size` {block_size}: choose one of {', '.join(map(str, BLOCK_SIZES))}")
    if accuracy_level not in ACCURACY_LEVELS:
        raise ValueError(f"`accuracy_level` {accuracy_level}: choose one of {', '.join(map(str, ACCURACY_LEVELS))}")
    return WEIGHT_ONLY_BITS[precision]


def quantize_weight_only(model: onnx.ModelProto, precision: str, *, block_size: int = DEFAULT_BLOCK_SIZE,
                         accuracy_level: int = DEFAULT_ACCURACY_LEVEL, keep_share: float = 0.0,
                         source_dir: Path | None = None) -> tuple[onnx.ModelProto, WeightOnlyQuantization]:
    """`model` (changed in place and returned) with every MatMul of constant 2-D weights as
    MatMulNBits of `precision`'s bits, a share `keep_share` of its feed-forward output MatMuls kept
    at the higher precision (the module's docstring), and how.

    Weights `model` references in files (a graph loaded with external_data.load_structure) are read
    from `source_dir` one MatMul at a time, just before it is quantized, and let go after: the fp32
    weights are never in memory together, only their quantized copies (0.16x at 4 bits), so a graph
    whose fp32 weights exceed the host's memory is quantized all the same. The bytes are the same
    as with every weight in memory (tests/unit/test_weight_only.py)."""
    bits = check_settings(precision, block_size, accuracy_level)
    if not 0.0 <= keep_share <= 1.0:
        raise ValueError(f"keep_share is a fraction between 0 and 1, not {keep_share}")
    _name_nodes(model)
    weights = _matmul_weights(model)
    ranked, _ = ffn_outputs_by_error(model, None)
    kept = [name for name in ranked[:math.ceil(keep_share * len(ranked))] if name in weights]
    model = _quantize(model, bits, block_size, accuracy_level, exclude=kept, source_dir=source_dir)
    if kept and bits == 4:  # the kept products at 8 bits: the only MatMuls with constant weights left
        model = _quantize(model, 8, block_size, accuracy_level, exclude=[], source_dir=source_dir)
    nbits = [node for node in model.graph.node if node.op_type == "MatMulNBits"]
    initializers = {init.name: init for init in model.graph.initializer}
    stored = sum(_nbytes(initializers[name]) for node in nbits for name in node.input[1:4] if name in initializers)
    left = _matmul_weights(model)
    return model, WeightOnlyQuantization(
        method=METHOD.format(bits=bits, block_size=block_size, accuracy_level=accuracy_level),
        bits=bits, block_size=block_size, accuracy_level=accuracy_level, keep_share=keep_share, kept=kept,
        kept_as="8 bits" if bits == 4 else "fp32", matmuls_quantized=len(nbits),
        matmuls_fp32=len(left), weight_bytes_fp32=sum(size for name, size in weights.items() if name not in left),
        weight_bytes=stored)


def quantize_linear(name: str, weight: np.ndarray, bits: int, block_size: int, accuracy_level: int
                    ) -> tuple[onnx.NodeProto, list[onnx.TensorProto]]:
    """One linear layer's weight (`weight`: [out N, in K], as torch stores it) as MatMulNBits: the
    node (inputs `x` and its initializers, output `y`) and its initializers (packed weights, scales,
    zero points, named after `name`), in memory. The quantizer of `quantize_weight_only`, run on a
    graph of this one MatMul: what the streamed export (exporters/streamed.py) writes weight by
    weight, the same bytes a whole graph's quantization gives the same weight."""
    if weight.ndim != 2:
        raise ValueError(f"{name}: a linear weight is [out, in], not {list(weight.shape)}")
    rows, width = weight.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", name], ["y"], name=f"{name}_matmul")], "linear",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["rows", width])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["rows", rows])],
        [numpy_helper.from_array(np.ascontiguousarray(weight.T, dtype=np.float32), name)])
    model = _quantize(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), bits, block_size,
                      accuracy_level, exclude=[], source_dir=None)
    (node,) = model.graph.node
    if node.op_type != "MatMulNBits":
        raise ValueError(f"{name}: onnxruntime's quantizer left the MatMul of a {list(weight.shape)} weight as "
                         f"{node.op_type}")
    return node, list(model.graph.initializer)


def _quantize(model: onnx.ModelProto, bits: int, block_size: int, accuracy_level: int, *,
              exclude: list[str], source_dir: Path | None) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quiet = logging.getLogger("onnxruntime.quantization")  # one info line per MatMul otherwise
    previous = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=False,
                                         accuracy_level=accuracy_level or None, nodes_to_exclude=exclude,
                                         op_types_to_quantize=("MatMul",))
        if source_dir is not None:
            quantizer.node_quantizer.quantize = _weights_read_in_turn(  # type: ignore[union-attr]
                quantizer.node_quantizer.quantize, model, Path(source_dir))  # type: ignore[union-attr]
        quantizer.process()
    finally:
        quiet.setLevel(previous)
    result = quantizer.model  # an ONNXModel wrapping the graph, for the DEFAULT algorithm
    return result if isinstance(result, onnx.ModelProto) else result.model


def _weights_read_in_turn(quantize: NodeQuantizer, model: onnx.ModelProto, source_dir: Path) -> NodeQuantizer:
    """The quantizer's per-node step with the node's weights read from their file just before and
    made a reference again just after: the quantizer's own `clean_initializers` then drops the
    fp32 tensors no node uses any more, which were never all in memory."""
    def in_turn(node: onnx.NodeProto, graph_stack: list[onnx.GraphProto]) -> list[onnx.NodeProto]:
        tensor = None
        if node.op_type == "MatMul" and len(node.input) > 1:
            tensor = next((init for init in model.graph.initializer if init.name == node.input[1]), None)
        if tensor is None or not unloaded(tensor):
            return quantize(node, graph_stack)
        reference = [(entry.key, entry.value) for entry in tensor.external_data]
        load_external_data_for_tensor(tensor, str(source_dir))
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]
        try:
            return quantize(node, graph_stack)
        finally:
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, value in reference:
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
    return in_turn


def _name_nodes(model: onnx.ModelProto) -> None:
    """Name the unnamed MatMuls (the quantizer excludes by name)."""
    for index, node in enumerate(model.graph.node):
        if node.op_type == "MatMul" and not node.name:
            node.name = f"matmul_{index}"


def _matmul_weights(model: onnx.ModelProto) -> dict[str, int]:
    """MatMul node name -> the bytes of its constant 2-D (or leading-ones N-D) fp32 weights."""
    initializers = {init.name: init for init in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        weights = initializers.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if weights is not None and len(weights.dims) >= 2 and all(d == 1 for d in weights.dims[:-2]):
            found[node.name] = _nbytes(weights)
    return found


def _nbytes(tensor: onnx.TensorProto) -> int:
    """The tensor's bytes, without reading external data."""
    if tensor.raw_data:
        return len(tensor.raw_data)
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return int(np.prod(tensor.dims)) * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return int(numpy_helper.to_array(tensor).nbytes)
