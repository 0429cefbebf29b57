"""Which MatMuls int8 builds may keep in fp32 (exporters/optimize/quantization.py): the feed-forward
output products, fed by a GELU or, in SwiGLU networks such as ESM C, by silu(gate) * up; small
hand-built ONNX graphs, one of each, and a product that is neither; and how a ladder of candidates
shares the quantization of the MatMuls none of them keeps."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bionemo_export.exporters.optimize.quantization import ffn_outputs_by_error, quantize_all_but, quantize_int8
from tests.helpers.onnx_graphs import feed_forward_graph


def _graph(kind: str) -> onnx.ModelProto:
    """x [2, 4] -> gate/up MatMuls -> (kind's product) -> down MatMul named "down" -> y."""
    weights = {name: numpy_helper.from_array(np.full((4, 4), 0.1, np.float32), name) for name in ("wg", "wu", "wd")}
    nodes = [helper.make_node("MatMul", ["x", "wg"], ["gate"]), helper.make_node("MatMul", ["x", "wu"], ["up"])]
    if kind == "swiglu":  # torch.onnx's F.silu: gate * sigmoid(gate)
        nodes += [helper.make_node("Sigmoid", ["gate"], ["sig"]), helper.make_node("Mul", ["gate", "sig"], ["silu"]),
                  helper.make_node("Mul", ["silu", "up"], ["product"])]
    elif kind == "silu-op":
        nodes += [helper.make_node("Swish", ["gate"], ["silu"], domain="com.microsoft"),
                  helper.make_node("Mul", ["silu", "up"], ["product"])]
    else:  # a plain gated product: no activation, not a feed-forward output
        nodes += [helper.make_node("Mul", ["gate", "up"], ["product"])]
    nodes.append(helper.make_node("MatMul", ["product", "wd"], ["y"], name="down"))
    graph = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], list(weights.values()))
    return helper.make_model(graph)


def test_swiglu_products_are_feed_forward_outputs_and_a_plain_product_is_not():
    assert ffn_outputs_by_error(_graph("swiglu"), None)[0] == ["down"]
    assert ffn_outputs_by_error(_graph("silu-op"), None)[0] == ["down"]
    assert ffn_outputs_by_error(_graph("plain"), None)[0] == []


def _two_blocks() -> onnx.ModelProto:
    """x [n, 8] -> two feed-forward blocks (up MatMul, erf GELU, down MatMul named down0/down1) -> y."""
    return feed_forward_graph(8, 16, 2, seed=3, scaled=False, residual=False)


@pytest.mark.parametrize("weights", ["int8", "uint8"])
def test_a_ladder_quantizing_on_the_shared_rest_computes_what_quantizing_whole_does(weights):
    """A ladder quantizes every MatMul but the ranked ones once (quantize_all_but), and each candidate
    only the ranked ones it does not keep: the same integers and scales as quantizing the graph whole."""
    import onnxruntime as ort

    model = _two_blocks()
    x = np.random.default_rng(4).standard_normal((5, 8)).astype(np.float32)
    ranking = ffn_outputs_by_error(model, {"x": x}, weights)
    assert sorted(ranking[0]) == ["down0", "down1"]
    rest = quantize_all_but(model, ranking[0], weights)

    def run(graph: onnx.ModelProto) -> np.ndarray:
        session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
        return np.asarray(session.run(None, {"x": x})[0])

    for keep in (0.0, 0.5, 1.0):
        whole, whole_record = quantize_int8(model, keep, None, False, weights, ranking=ranking)
        shared, shared_record = quantize_int8(model, keep, None, False, weights, ranking=ranking, rest_quantized=rest)
        assert shared_record == whole_record
        assert shared_record.matmuls_int8 == 4 - round(keep * 2)
        np.testing.assert_array_equal(run(shared), run(whole))
    assert sum(node.op_type == "MatMulInteger" for node in rest.graph.node) == 2  # the up projections


def test_a_ladder_quantizes_the_rest_once_whichever_order_ranks_its_matmuls(tmp_path):
    """A ladder's first candidate ranks by position, the others by error: the same MatMuls, so one
    rest-quantized graph serves them all."""
    from bionemo_export.exporters.optimize.candidates import fuse_graph

    onnx.save(_two_blocks(), str(tmp_path / "model.onnx"))
    fused = fuse_graph(tmp_path / "model.onnx", num_heads=None, hidden_size=None, fuse=False)
    first = fused.int8_rest_quantized(["down1", "down0"], "int8")
    assert fused.int8_rest_quantized(["down0", "down1"], "int8") is first
    assert fused.int8_rest_quantized(["down0", "down1"], "uint8") is not first
