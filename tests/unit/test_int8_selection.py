"""Which MatMuls int8 builds may keep in fp32 (exporters/optimize/quantization.py): the feed-forward
output products, fed by a GELU or, in SwiGLU networks such as ESM C, by silu(gate) * up; small
hand-built ONNX graphs, one of each, and a product that is neither."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bionemo_export.exporters.optimize.quantization import ffn_outputs_by_error


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
