"""The exact u8u8 twin of an int8-weight graph (exporters/optimize/quantization.py write_exact_twin),
through which a build host without VNNI checks the graph VNNI hosts will open.

The reference is brute-force integer arithmetic in numpy: DynamicQuantizeLinear's uint8 activations
times the stored int8 weights, summed exactly in int64, then scaled. ONNX Runtime's AVX2 kernels
saturate pairs of u8 x s8 products in 16 bits; the twin must not, on any host. Activations near 255
and weights near 127 make the pairs that overflow: on a 2-core AVX2-only EPYC the int8 graph itself
was 7% off (relative max error) on this input, its twin within float rounding (2026-11-27).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from bionemo_export.exporters.optimize.quantization import write_exact_twin

K, N = 64, 16


def _quantized(tmp_path: Path, weight_type: QuantType, fused: bool) -> Path:
    """y = x @ w quantized per output column; `fused`: as ONNX Runtime's offline optimization stores
    it (DynamicQuantizeMatMul), else as quantize_dynamic writes it (MatMulInteger)."""
    w = np.random.default_rng(0).normal(size=(K, N)).astype(np.float32)
    w[:, :4] = np.abs(w[:, :4]) * 5  # columns whose int8 weights sit near +127
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
                              [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "fp32.onnx")
    quantize_dynamic(tmp_path / "fp32.onnx", tmp_path / "int8.onnx", per_channel=True, weight_type=weight_type,
                     extra_options={"MatMulConstBOnly": True})
    if not fused:
        return tmp_path / "int8.onnx"
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "fused.onnx")
    ort.InferenceSession(str(tmp_path / "int8.onnx"), options, providers=["CPUExecutionProvider"])
    return tmp_path / "fused.onnx"


def _exact(graph: Path, x: np.ndarray) -> np.ndarray:
    """The integer arithmetic of the int8 graph, without saturation."""
    values = {init.name: numpy_helper.to_array(init) for init in onnx.load(str(graph)).graph.initializer}
    weights = next(v for v in values.values() if v.dtype == np.int8 and v.ndim == 2).astype(np.int64)
    zeros = next(v for v in values.values() if v.dtype == np.int8 and v.ndim == 1).astype(np.int64)
    scales = next(v for v in values.values() if v.dtype == np.float32 and v.shape == (N,))
    low, high = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    x_scale = np.float32((high - low) / 255)
    x_zero = np.clip(np.round(-low / x_scale), 0, 255)
    quantized = np.clip(np.round(x / x_scale) + x_zero, 0, 255).astype(np.int64)
    return ((quantized - int(x_zero)) @ (weights - zeros)).astype(np.float64) * x_scale * scales


def _relative_error(twin: Path, graph: Path) -> float:
    """The twin's max abs error against `graph`'s exact integer arithmetic, relative to the answer's
    largest value, on an input whose first row is all 255s after quantization: against the +127
    columns, each pair of products overflows 16 bits."""
    x = np.abs(np.random.default_rng(1).normal(size=(3, K))).astype(np.float32) * 10
    x[0] = x.max()
    expected = _exact(graph, x)
    got = ort.InferenceSession(str(twin), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    return float(np.abs(got - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("fused", [False, True], ids=["MatMulInteger", "DynamicQuantizeMatMul"])
def test_the_twin_computes_the_exact_integer_sums_on_this_host(tmp_path, fused):
    graph = _quantized(tmp_path, QuantType.QInt8, fused)
    assert write_exact_twin(graph, tmp_path / "twin" / "model.onnx")
    twin = onnx.load(str(tmp_path / "twin" / "model.onnx"))
    assert not [init.name for init in twin.graph.initializer if init.data_type == TensorProto.INT8]
    assert {node.op_type for node in twin.graph.node} == {node.op_type for node in onnx.load(str(graph)).graph.node}
    assert _relative_error(tmp_path / "twin" / "model.onnx", graph) <= 1e-5


def test_a_graph_with_external_weights_gets_a_twin_with_external_weights(tmp_path):
    graph = _quantized(tmp_path, QuantType.QInt8, fused=True)
    onnx.save(onnx.load(str(graph)), tmp_path / "external.onnx", save_as_external_data=True,
              location="external.onnx.data", size_threshold=0)
    assert write_exact_twin(tmp_path / "external.onnx", tmp_path / "twin" / "model.onnx")
    assert (tmp_path / "twin" / "model.onnx.data").is_file()
    assert _relative_error(tmp_path / "twin" / "model.onnx", graph) <= 1e-5


def test_a_weight_without_its_zero_point_input_gets_one_of_128(tmp_path):
    """The zero point is optional (absent: 0). Shifted to uint8 the weights need 128, so the twin adds it."""
    graph = _quantized(tmp_path, QuantType.QInt8, fused=False)
    model = onnx.load(str(graph))
    node = next(node for node in model.graph.node if node.op_type == "MatMulInteger")
    zero = next(init for init in model.graph.initializer if init.name == node.input[3])
    assert not numpy_helper.to_array(zero).any()  # symmetric int8 weights: the zero point was 0 anyway
    del node.input[3]
    onnx.save(model, tmp_path / "no-zero.onnx")
    assert write_exact_twin(tmp_path / "no-zero.onnx", tmp_path / "twin" / "model.onnx")
    twin = onnx.load(str(tmp_path / "twin" / "model.onnx"))
    matmul = next(node for node in twin.graph.node if node.op_type == "MatMulInteger")
    added = next(init for init in twin.graph.initializer if init.name == matmul.input[3])
    assert added.data_type == TensorProto.UINT8 and (numpy_helper.to_array(added) == 128).all()
    assert _relative_error(tmp_path / "twin" / "model.onnx", graph) <= 1e-5


def test_a_graph_without_int8_weights_has_no_twin(tmp_path):
    assert not write_exact_twin(_quantized(tmp_path, QuantType.QUInt8, fused=True), tmp_path / "twin.onnx")
    assert not (tmp_path / "twin.onnx").exists()


def test_an_int8_weight_read_by_another_node_is_refused(tmp_path):
    graph = onnx.load(str(_quantized(tmp_path, QuantType.QInt8, fused=False)))
    weights = next(init.name for init in graph.graph.initializer if init.data_type == TensorProto.INT8
                   and len(init.dims) == 2)
    graph.graph.node.append(helper.make_node("Identity", [weights], ["leak"], name="leak"))
    graph.graph.output.append(helper.make_tensor_value_info("leak", TensorProto.INT8, [K, N]))
    onnx.save(graph, tmp_path / "leaky.onnx")
    with pytest.raises(ValueError, match=rf"int8 initializer {weights} also feeds input 0 of Identity 'leak'"):
        write_exact_twin(tmp_path / "leaky.onnx", tmp_path / "twin.onnx")
    assert not (tmp_path / "twin.onnx").exists()
