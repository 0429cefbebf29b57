"""Small hand-built ONNX graphs for the quantization tests: feed-forward blocks as transformer
layers have them (up MatMul, erf GELU, down MatMul), with the node names the quantizers rank by."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def feed_forward_graph(width: int, inner: int, blocks: int, *, seed: int, scaled: bool, residual: bool
                       ) -> onnx.ModelProto:
    """x [n, width] -> `blocks` feed-forward blocks -> y [n, width]. Block B's MatMuls are named
    "upB" and "downB" (weights "w_upB", "w_downB", standard normal; divided by sqrt(K) where
    `scaled`, as a trained layer's are); with `residual` each block's output is added to its input."""
    rng = np.random.default_rng(seed)
    nodes, weights, value = [], [], "x"
    for block in range(blocks):
        up, down = f"up{block}", f"down{block}"
        for name, shape in ((up, (width, inner)), (down, (inner, width))):
            drawn = rng.standard_normal(shape)
            weights.append(numpy_helper.from_array((drawn / shape[0] ** 0.5 if scaled else drawn).astype(np.float32),
                                                   f"w_{name}"))
        nodes += [helper.make_node("MatMul", [value, f"w_{up}"], [up], name=up),
                  helper.make_node("Div", [up, "sqrt2"], [f"{up}_scaled"]),
                  helper.make_node("Erf", [f"{up}_scaled"], [f"{up}_erf"]),
                  helper.make_node("Add", [f"{up}_erf", "one"], [f"{up}_erf1"]),
                  helper.make_node("Mul", [up, f"{up}_erf1"], [f"{up}_x"]),
                  helper.make_node("Mul", [f"{up}_x", "half"], [f"{up}_gelu"]),
                  helper.make_node("MatMul", [f"{up}_gelu", f"w_{down}"], [down], name=down)]
        if residual:
            nodes.append(helper.make_node("Add", [value, down], [f"sum{block}"]))
        value = f"sum{block}" if residual else down
    constants = [numpy_helper.from_array(np.array(v, np.float32), name)
                 for name, v in (("sqrt2", 2 ** 0.5), ("one", 1.0), ("half", 0.5))]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width])]
    outputs = [helper.make_tensor_value_info(value, TensorProto.FLOAT, ["n", width])]
    graph = helper.make_graph(nodes, "feed_forward", inputs, outputs, weights + constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
