"""The weights a `com.microsoft.MatMulNBits` node stores, read back from its initializers by the
operator's documented layout (onnxruntime's ContribOperators.md), independently of the quantizer
that wrote them:

- B: uint8 [N, blocks, block_size x bits / 8], row n's K weights in blocks of `block_size`; at
  4 bits two weights a byte, the lower nibble first;
- scales: fp32 [N x blocks] (or [N, blocks]);
- zero_points: uint8, [N, ceil(blocks / 2)] at 4 bits (lower nibble first), [N, blocks] at 8;
- weight = (q - zero point) x scale; K may end inside the last block (padding).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper


def dequantized_weights(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> np.ndarray:
    """`node`'s weights as the fp32 [N, K] matrix it computes with (torch's Linear layout)."""
    attributes = {attribute.name: attribute.i for attribute in node.attribute}
    k, n, bits, block = attributes["K"], attributes["N"], attributes["bits"], attributes["block_size"]
    packed = numpy_helper.to_array(initializers[node.input[1]])
    scales = numpy_helper.to_array(initializers[node.input[2]]).reshape(n, -1).astype(np.float32)
    zeros = numpy_helper.to_array(initializers[node.input[3]])
    blocks = scales.shape[1]
    if bits == 4:
        q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, blocks, block)
        z = np.stack([zeros & 15, zeros >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    else:
        q = packed.reshape(n, blocks, block)
        z = zeros.reshape(n, blocks)
    weights = (q.astype(np.float32) - z[..., None].astype(np.float32)) * scales[..., None]
    return weights.reshape(n, blocks * block)[:, :k]
