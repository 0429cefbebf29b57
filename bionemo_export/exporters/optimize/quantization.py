"""Reduced precision for a stored graph: int8 (ONNX Runtime's dynamic quantization, for CPUs) and
fp16 (float16 weights and compute, for GPU hosts).

    model, record = quantize_int8(model, keep_fp32=0.25, calibration=batch, external=False)
    model, record = convert_fp16(model, external=False)

int8 = `onnxruntime.quantization.quantize_dynamic`: 8-bit weights per output channel for MatMul with
constant weights; uint8 activations quantized per tensor at run time. Two weight types, because
x86 CPUs do not all compute the same integer products:

- `int8` weights (u8s8, the default): VNNI/AMX CPUs (avx512_vnni, avx_vnni, amx_int8) accumulate the
  8-bit products in 32 bits, exactly, and fast. CPUs without VNNI (AVX2-only, AVX-512 without VNNI)
  add pairs of products into saturating 16-bit lanes (vpmaddubsw), which transformer activations
  overflow: the real AntiBERTy's embeddings fell from min cosine 0.9993 to 0.994 (measured under
  `qemu-x86_64 -cpu Haswell` on the same graph and inputs).
- `uint8` weights (u8u8, `PORTABLE_WEIGHTS`): every x86 kernel widens these to 16 bits before
  multiplying, so the integer sums are exact everywhere (the answers still differ slightly between
  CPUs: the activations are quantized from fp32 values each CPU's kernels round in their own way;
  docs/building.md has the figures). Slower than u8s8 on VNNI hosts
  (~1.8x on AntiBERTy), so a build stores it as the graph for hosts without VNNI, beside the u8s8 one.
- A build host without VNNI checks a u8s8 graph through its exact twin (`write_exact_twin`: the int8
  weights and zero points shifted by 128 into uint8, the same integers), which sums there what
  VNNI hosts sum: the saturating kernels of an AVX2-only build host used to reject AntiBERTy's u8s8
  graph and all its fallbacks.

`keep_fp32` leaves a share of the feed-forward output MatMuls (those fed by a GELU, or by a SwiGLU's
product as in ESM C: the most sensitive to int8) in fp32: those whose simulated int8 error on a
calibration batch is largest.
fp16 = `onnxruntime.transformers.float16` with float32 graph inputs and outputs, the layer norms and
the residual stream kept in fp32 (`FP32_NORMALIZATIONS`, and every Add whose sum a layer norm reads):
outside TransformerEngine the residual stream of ESM C grows to magnitudes where fp16's spacing (2 at
2048, 32 at 32768) swallows each block's update, and a norm over fp16 inputs sees that rounding.
The rest (attention, feed-forward: the MatMuls, which are the cost) runs in fp16.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .graph import GraphView

INT8_METHOD = ("onnxruntime.quantization.quantize_dynamic: {weights} weights per output channel, "
               "MatMuls with constant weights; uint8 activations quantized per tensor at run time")
WEIGHT_TYPES = ("int8", "uint8")
"""The weight types quantize_int8 makes: int8 (u8s8, exact on VNNI CPUs only), uint8 (u8u8, exact on every x86 CPU)."""
PORTABLE_WEIGHTS = "uint8"
FP16_METHOD = ("onnxruntime.transformers.float16: float16 weights and compute; float32 graph inputs and outputs, "
               "layer norms and the residual additions they read")
FP32_NORMALIZATIONS = ("LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
                       "SkipSimplifiedLayerNormalization", "RMSNormalization")
"""Normalizations an fp16 graph computes in fp32 (with the residual additions they read)."""



@dataclass(frozen=True)
class Int8Quantization:
    """How an int8 graph was quantized (manifest.json's `optimization.quantization`)."""

    method: str
    keep_fp32: float
    """The share of the feed-forward output MatMuls asked to stay in fp32."""
    kept_fp32: list[str]
    """The MatMul nodes left in fp32, in the order they were chosen."""
    kept_fp32_chosen_by: str | None
    """How they were ranked; None when none was kept."""
    matmuls_int8: int
    matmuls_fp32: int
    weights: str = "int8"
    """"int8" (u8s8 kernels: exact on VNNI CPUs) or "uint8" (u8u8: exact on every x86 CPU)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Fp16Conversion:
    """How an fp16 graph was converted (manifest.json's `optimization.quantization`)."""

    method: str = FP16_METHOD
    normalizations_fp32: int = 0
    """Layer-norm nodes left in fp32."""
    residual_additions_fp32: int = 0
    """Add nodes left in fp32 because a layer norm reads their sum (the residual stream)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def quantize_int8(model: onnx.ModelProto, keep_fp32: float, calibration: dict[str, np.ndarray] | None,
                  external: bool, weights: str = "int8", *, ranking: tuple[list[str], str] | None = None,
                  rest_quantized: onnx.ModelProto | None = None) -> tuple[onnx.ModelProto, Int8Quantization]:
    """`model` with 8-bit MatMuls (`weights` "int8" or "uint8": the module's docstring), a share
    `keep_fp32` of its feed-forward output MatMuls left in fp32
    (ranked on `calibration`, one batch of graph inputs, when given and the graph has no external
    data; else the last layers first), and how it was done. `ranking`: that order, already computed
    by `ffn_outputs_by_error` for this graph (a ladder's candidates share it). `rest_quantized`:
    `quantize_all_but(model, ranking's names, weights)`, shared by a ladder's candidates, which then
    quantize only the ranked MatMuls they do not keep (the same graph, bit for bit in what it computes:
    each MatMul's weights and input are quantized on their own; AntiBERTy's six candidates, under
    cProfile: 15 s of quantizing without it, 8 s with it). `model` is changed only in naming its unnamed feed-forward
    output MatMuls (ffn_outputs_by_error: exclusion is by name)."""
    if weights not in WEIGHT_TYPES:
        raise ValueError(f"int8 weights are one of {', '.join(WEIGHT_TYPES)}, not {weights!r}")
    if ranking is None:
        ranking = ffn_outputs_by_error(model, calibration if keep_fp32 and not external else None, weights)
    ranked, ranked_by = ranking
    excluded = ranked[:math.ceil(keep_fp32 * len(ranked))]
    if rest_quantized is None:
        quantized = _quantize_dynamic(model, weights, external, exclude=excluded)
    elif len(excluded) < len(ranked):
        quantized = _quantize_dynamic(rest_quantized, weights, external, only=ranked[len(excluded):])
    else:  # every ranked MatMul kept: the shared graph as it is, copied (the caller may change its copy)
        quantized = onnx.ModelProto()
        quantized.CopyFrom(rest_quantized)
    counts = collections.Counter(node.op_type for node in quantized.graph.node)
    return quantized, Int8Quantization(
        method=INT8_METHOD.format(weights=weights), weights=weights, keep_fp32=keep_fp32, kept_fp32=excluded,
        kept_fp32_chosen_by=ranked_by if excluded else None,
        matmuls_int8=counts["MatMulInteger"], matmuls_fp32=counts["MatMul"])


def quantize_all_but(model: onnx.ModelProto, names: list[str], weights: str) -> onnx.ModelProto:
    """`model` (without external data: it is held in memory for the ladder) with every MatMul
    quantize_int8 quantizes made 8-bit except the nodes `names` (a ladder's ranked feed-forward
    outputs): what the ladder's candidates share (quantize_int8's `rest_quantized`)."""
    return _quantize_dynamic(model, weights, False, exclude=names)


def _quantize_dynamic(model: onnx.ModelProto, weights: str, external: bool, *, exclude: list[str] | None = None,
                      only: list[str] | None = None) -> onnx.ModelProto:
    """ONNX Runtime's quantize_dynamic of `model` with this module's settings, skipping the nodes named in
    `exclude`, or quantizing only those named in `only` (non-empty: an empty list means all to ONNX Runtime)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    if only is not None and not only:
        raise ValueError("`only` names at least one node (ONNX Runtime reads an empty list as every node)")
    with tempfile.TemporaryDirectory(prefix="bionemo-export-int8-") as work:
        out = Path(work) / "int8.onnx"
        quantize_dynamic(
            model, str(out), op_types_to_quantize=["MatMul", "Gemm"], per_channel=True, reduce_range=False,
            weight_type=QuantType.QInt8 if weights == "int8" else QuantType.QUInt8, nodes_to_exclude=exclude,
            nodes_to_quantize=only, use_external_data_format=external,
            extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT},
        )
        return onnx.load(str(out))


def ffn_outputs_by_error(model: onnx.ModelProto, calibration: dict[str, np.ndarray] | None,
                          weights: str = "int8") -> tuple[list[str], str]:
    """The feed-forward output MatMuls (input from a GELU or a SwiGLU, weights constant), largest simulated
    int8 error first: relative error of (uint8 per-tensor input) x (8-bit per-column `weights`)
    against fp32 on the calibration batch. Without a calibration batch: last layers first."""
    view = GraphView(model.graph)
    nodes = []
    for index, node in enumerate(model.graph.node):
        if node.op_type != "MatMul" or node.input[1] not in view.initializers:
            continue
        producer = view.producer.get(node.input[0])
        if producer is not None and (producer.op_type in ("Gelu", "BiasGelu", "FastGelu", "QuickGelu")
                                     or _is_erf_gelu(view, producer) or _is_swiglu(view, producer)):
            node.name = node.name or f"matmul_{index}"
            nodes.append(node)
    if calibration is None or not nodes:
        return [node.name for node in reversed(nodes)], "position (last layers first)"
    import onnxruntime as ort

    from bionemo_export.exporters.runtime_session import session_options

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    names = list(dict.fromkeys(node.input[0] for node in nodes))
    probe.graph.output.extend(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in names)
    session = ort.InferenceSession(probe.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    inputs = {value.name: calibration[value.name] for value in session.get_inputs()}
    # ONNX Runtime returns these outputs as arrays (its stubs allow lists and sparse tensors).
    activations = {name: np.asarray(value) for name, value in zip(names, session.run(names, inputs))}
    errors: dict[str, float] = {}
    for node in nodes:
        x = activations[node.input[0]].reshape(-1, activations[node.input[0]].shape[-1]).astype(np.float64)
        w = numpy_helper.to_array(view.initializers[node.input[1]]).astype(np.float64)
        exact = x @ w
        simulated = _fake_quantize_activations(x) @ _fake_quantize_weights(w, weights)
        errors[node.name] = float(np.linalg.norm(simulated - exact) / max(np.linalg.norm(exact), 1e-30))
    ranked = sorted(errors, key=lambda name: errors[name], reverse=True)
    return ranked, "simulated int8 error on the build's sample batch"


def _fake_quantize_activations(x: np.ndarray) -> np.ndarray:
    """What DynamicQuantizeLinear does: uint8, asymmetric, one scale for the tensor."""
    low, high = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = (high - low) / 255 or 1.0
    zero = np.round(-low / scale)
    return (np.clip(np.round(x / scale) + zero, 0, 255) - zero) * scale


def _fake_quantize_weights(w: np.ndarray, weights: str = "int8") -> np.ndarray:
    """One scale per output column (per_channel=True): int8 symmetric, or uint8 asymmetric."""
    if weights == "int8":
        scale = np.abs(w).max(axis=0, keepdims=True) / 127
        scale[scale == 0] = 1.0
        return np.round(w / scale) * scale
    low, high = np.minimum(w.min(axis=0, keepdims=True), 0.0), np.maximum(w.max(axis=0, keepdims=True), 0.0)
    scale = (high - low) / 255
    scale[scale == 0] = 1.0
    zero = np.round(-low / scale)
    return (np.clip(np.round(w / scale) + zero, 0, 255) - zero) * scale


def _is_erf_gelu(view: GraphView, node: onnx.NodeProto) -> bool:
    """Whether `node` ends an unfused erf GELU (x * 0.5 * (1 + erf(x / sqrt 2)) in some order)."""
    if node.op_type != "Mul":
        return False
    frontier, seen = [node], 0
    while frontier and seen < 6:
        current = frontier.pop()
        seen += 1
        if current.op_type == "Erf":
            return True
        frontier += [view.producer[name] for name in current.input if name in view.producer]
    return False


def _is_swiglu(view: GraphView, node: onnx.NodeProto) -> bool:
    """Whether `node` is a SwiGLU's product: silu(gate) * up, SiLU as one op or x * sigmoid(x)."""
    if node.op_type != "Mul":
        return False
    return any(_is_silu(view, view.producer[name]) for name in node.input if name in view.producer)


def _is_silu(view: GraphView, node: onnx.NodeProto) -> bool:
    if node.op_type in ("Silu", "Swish"):
        return True
    return node.op_type == "Mul" and any(view.producer[name].op_type == "Sigmoid" for name in node.input
                                         if name in view.producer)


def convert_fp16(model: onnx.ModelProto, external: bool) -> tuple[onnx.ModelProto, Fp16Conversion]:
    """`model` with float16 weights and compute, its inputs and outputs still float32, its layer
    norms and the residual additions they read in float32 (the module's docstring), and how it was done."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    norms = [node for node in model.graph.node if node.op_type in FP32_NORMALIZATIONS]
    residuals = residual_additions(model)
    converted = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=external,
                                         op_block_list=[*DEFAULT_OP_BLOCK_LIST, *FP32_NORMALIZATIONS],
                                         node_block_list=residuals)
    _drop_fp16_round_trips(converted)
    return converted, Fp16Conversion(normalizations_fp32=len(norms), residual_additions_fp32=len(residuals))


def _drop_fp16_round_trips(model: onnx.ModelProto) -> None:
    """Read fp32 values where the converter casts them to fp16 and straight back.

    The converter casts every fp32-kept node's output down to fp16 and every fp32-kept node's input
    up again, even between two such nodes: the residual sum would reach the norm (and the next
    residual addition) through fp16 and overflow past 65504 all the same. Each Cast-to-fp32 of a
    Cast-to-fp16's output is bypassed here (its readers take the fp32 original) and the casts left
    unread are removed."""
    view = GraphView(model.graph)
    float32, float16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    renamed: dict[str, str] = {}
    for node in model.graph.node:
        source = view.producer.get(node.input[0]) if node.op_type == "Cast" and node.input else None
        if (source is not None and source.op_type == "Cast" and _cast_to(node) == float32
                and _cast_to(source) == float16 and node.output[0] not in view.outputs):
            renamed[node.output[0]] = source.input[0]
    if not renamed:
        return
    for node in model.graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
    while True:  # a removed cast may leave the cast it read unread
        read = {name for node in model.graph.node for name in node.input} | view.outputs
        keep = [node for node in model.graph.node
                if node.op_type != "Cast" or any(name in read for name in node.output)]
        if len(keep) == len(model.graph.node):
            return
        del model.graph.node[:]
        model.graph.node.extend(keep)


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((attribute.i for attribute in node.attribute if attribute.name == "to"), None)


def residual_additions(model: onnx.ModelProto) -> list[str]:
    """The names of the Add nodes whose sum a layer norm reads: the residual stream of a transformer
    (pre-norm: the sum also flows on to the next residual addition; post-norm: the norm's input).
    Nodes without a name are named here, since the converter blocks nodes by name."""
    norm_inputs = {node.input[0] for node in model.graph.node if node.op_type in FP32_NORMALIZATIONS and node.input}
    found = []
    for index, node in enumerate(model.graph.node):
        if node.op_type == "Add" and node.output[0] in norm_inputs:
            if not node.name:
                node.name = f"residual_add_{index}"
            found.append(node.name)
    return found


INTEGER_MATMUL_ZERO_POINTS = {"MatMulInteger": 3, "DynamicQuantizeMatMul": 3, "MatMulIntegerToFloat": 5}
"""The integer MatMuls of an int8 graph (quantize_dynamic's, and ONNX Runtime's fusions of them):
their weights are input 1, and the weights' zero point the input at this index."""


def write_exact_twin(src: Path, dst: Path) -> bool:
    """Write the u8u8 twin of the int8-weight (u8s8) graph `src` to `dst`: every int8 weight and its
    zero point shifted by 128 into uint8, so that (w + 128) - (z + 128) = w - z, the same integers.
    ONNX Runtime widens uint8 weights to 16 bits on every x86 CPU, so the twin sums on any host the
    integers VNNI/AMX hosts sum for `src` (AVX2 kernels saturate pairs of u8 x s8 products): how a
    build host without VNNI checks the graph that VNNI hosts will open. False (nothing written) when
    `src` has no int8 weights. ValueError when an int8 weight feeds something else than an integer
    MatMul's weight input (its meaning would change)."""
    model = onnx.load(str(src), load_external_data=False)
    external = any(init.data_location == onnx.TensorProto.EXTERNAL for init in model.graph.initializer)
    if external:
        onnx.load_external_data_for_model(model, str(src.parent))
    initializers = {init.name: init for init in model.graph.initializer}
    shifted: dict[str, onnx.TensorProto] = {}
    for node in model.graph.node:
        zero_index = INTEGER_MATMUL_ZERO_POINTS.get(node.op_type)
        if zero_index is None or len(node.input) < 2:
            continue
        weights = initializers.get(node.input[1])
        if weights is None or weights.data_type != onnx.TensorProto.INT8:
            continue
        if len(node.input) <= zero_index or not node.input[zero_index]:  # absent: zero, which becomes 128
            zero = helper.make_tensor(f"{node.input[1]}_zero_point", onnx.TensorProto.INT8, [weights.dims[-1]],
                                      [0] * weights.dims[-1])
            model.graph.initializer.append(zero)
            initializers[zero.name] = zero
            node.input.extend([""] * (zero_index + 1 - len(node.input)))
            node.input[zero_index] = zero.name
        for name in (node.input[1], node.input[zero_index]):
            if name not in shifted:
                values = numpy_helper.to_array(initializers[name]).astype(np.int16) + 128
                shifted[name] = numpy_helper.from_array(values.astype(np.uint8), name)
    if not shifted:
        return False
    for node in model.graph.node:
        allowed = (1, INTEGER_MATMUL_ZERO_POINTS.get(node.op_type))
        for index, name in enumerate(node.input):
            if name in shifted and index not in allowed:
                raise ValueError(f"{src}: the int8 initializer {name} also feeds input {index} of {node.op_type} "
                                 f"{node.name!r}; only integer MatMul weights can be shifted to uint8")
    for init in model.graph.initializer:
        if init.name in shifted:
            init.CopyFrom(shifted[init.name])
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst), save_as_external_data=external, location=f"{dst.name}.data" if external else None)
    return True
