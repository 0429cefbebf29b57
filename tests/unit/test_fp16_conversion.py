"""fp16 graphs keep their layer norms and the residual additions those read in fp32
(exporters/optimize/quantization.py convert_fp16): a small hand-built pre-norm block whose residual
stream passes fp16's largest value (65504), run by ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.transformers.float16 import convert_float_to_float16

from bionemo_export.exporters.optimize.quantization import FP32_NORMALIZATIONS, convert_fp16, residual_additions

WIDTH = 4


def _block() -> onnx.ModelProto:
    """x [2, 4] -> update = x @ W; stream = x + update (the residual addition); y = LayerNorm(stream) @ V."""
    weights = [numpy_helper.from_array(np.eye(WIDTH, dtype=np.float32), "w"),
               numpy_helper.from_array(np.full(WIDTH, 1.0, np.float32), "gamma"),
               numpy_helper.from_array(np.zeros(WIDTH, np.float32), "beta"),
               numpy_helper.from_array(np.eye(WIDTH, dtype=np.float32) * 0.5, "v")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["update"], name="update"),
             helper.make_node("Add", ["x", "update"], ["stream"]),  # unnamed, as exporters may leave it
             helper.make_node("LayerNormalization", ["stream", "gamma", "beta"], ["normed"], axis=-1, epsilon=1e-5),
             helper.make_node("MatMul", ["normed", "v"], ["y"], name="project")]
    graph = helper.make_graph(nodes, "pre-norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, WIDTH])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _types(model: onnx.ModelProto) -> dict[str, int]:
    """Every value's element type, as the graph declares or ONNX infers it."""
    inferred = onnx.shape_inference.infer_shapes(model)
    values = [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
    return {value.name: value.type.tensor_type.elem_type for value in values}


def test_the_norm_and_the_residual_sum_it_reads_stay_fp32_and_the_matmuls_go_fp16():
    """What a GPU runs is what the graph declares. (ONNX Runtime's CPU provider is no judge here: for
    fp16 nodes it has no kernel for it inserts casts and computes in fp32, so a CPU run of a
    fully-fp16 graph shows no overflow; a build's fp16 accuracy on a CPU is an upper bound.)"""
    converted, record = convert_fp16(_block(), external=False)
    types = _types(converted)
    norm = next(node for node in converted.graph.node if node.op_type == "LayerNormalization")
    add = next(node for node in converted.graph.node if node.op_type == "Add")
    assert types[norm.input[0]] == types[norm.output[0]] == TensorProto.FLOAT
    assert types[add.output[0]] == TensorProto.FLOAT and all(types[name] == TensorProto.FLOAT for name in add.input)
    assert (record.normalizations_fp32, record.residual_additions_fp32) == (1, 1)
    matmuls = [node for node in converted.graph.node if node.op_type == "MatMul"]
    assert all(types[node.output[0]] == TensorProto.FLOAT16 for node in matmuls)
    stored = {init.name: init.data_type for init in converted.graph.initializer}
    assert stored["w"] == stored["v"] == TensorProto.FLOAT16
    # No value goes fp32 -> fp16 -> fp32 (the converter's casts around kept nodes), and no cast is left unread.
    casts = {node.output[0]: node for node in converted.graph.node if node.op_type == "Cast"}
    assert not any(cast.input[0] in casts for cast in casts.values())
    read = {name for node in converted.graph.node for name in node.input} | {"y"}
    assert all(name in read for name in casts)
    # Without the guard, the converter makes the sum and the norm fp16 (80000 would be inf there).
    plain = _types(convert_float_to_float16(_block(), keep_io_types=True))
    assert plain["stream"] == TensorProto.FLOAT16


def test_the_converted_block_answers_as_fp32_does_on_this_cpu():
    x = np.array([[40000.0, -40000.0, 20000.0, 1.0], [1.0, 2.0, 3.0, 4.0]], np.float32)

    def run(model: onnx.ModelProto) -> np.ndarray:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return np.asarray(session.run(["y"], {"x": x})[0])

    np.testing.assert_allclose(run(convert_fp16(_block(), external=False)[0]), run(_block()), atol=2e-3)


def test_residual_additions_are_the_sums_a_norm_reads_and_nothing_else():
    model = _block()
    assert residual_additions(model) == ["residual_add_1"]  # the unnamed Add got a name to block it by
    model.graph.node[2].op_type = "Relu"  # no norm reads the sum any more
    del model.graph.node[2].input[1:]
    assert residual_additions(model) == []
    assert "LayerNormalization" in FP32_NORMALIZATIONS
