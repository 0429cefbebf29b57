"""Key padding folded into the attention heads, so that ONNX Runtime's CPU attention runs its flash
kernel.

    folded = fold_padding_mask(model)   # in place; how many MultiHeadAttention nodes were rewritten

ONNX Runtime's CPU MultiHeadAttention runs MLAS's flash attention (scores in L2-sized tiles, no
[batch, heads, length, length] tensor) only when it has no mask at all; with an `attention_bias` it
computes, biases and normalizes the whole score tensor per head. An encoder's mask is a key-padding
mask: a bias of 0 for every real key and a very negative number for every padding key, the same for
every query and head. That bias is one more dimension of each head's dot product: each query head
gets a last element 1, each key head the key's bias divided by the attention's scale, so that

    scale * (q' . k') = scale * (q . k) + bias(key)

exactly for real keys (bias 0) and with FOLDED_MASK_VALUE for padding keys, whose softmax weight is
then exp(-1e4) = 0, as before. The values keep their head size (the node takes a query/key head
size apart from the value's). Measured on ESM-2 150M int8 (2 AVX-512 VNNI cores, onnxruntime 1.32):
1.06x at 8 x 128 tokens, 1.06x at 8 x 256, 1.15x at 4 x 512 per encoder pass; fp32 results equal
the unfolded graph's within 5e-6 (benchmarks/results/esm_cpp.md has the served figures).

A bias is folded only when it is such a mask: it is computed from the graph input `attention_mask`
(1 for a token, 0 for padding) and small constants alone, and evaluated on probe masks it is 0 for
every kept key and at most MASK_FILL_LIMIT for every padding key, equal over queries and heads. A
causal mask, a relative-position bias (T5's), or a bias read from any other input stays as it is.
fp16 graphs are not folded: they are for GPUs, whose fused attention kernels want a head size that
is a multiple of 8 (exporters/optimize/candidates.py applies this to CPU precisions only).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from .attention import MASK_FILL_LIMIT, MS_DOMAIN
from .graph import Constants, GraphView, attribute_value, remove_unused

PADDING_INPUT = "attention_mask"
"""The encoder graphs' padding mask input: INT64 [batch, length], 1 for a token, 0 for padding
(models/base.py)."""
FOLDED_MASK_VALUE = -1e4
"""What a padding key adds to a score once folded (MultiHeadAttention's own mask_filter_value)."""
PROBE_MASKS = ([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]],
               [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
"""The masks a candidate bias is evaluated on: full, half and one-token rows, two lengths."""
MAX_PROBED_CONSTANT_BYTES = 1 << 20
"""A bias whose subgraph reads a constant larger than this is not a padding mask (it reads weights)."""

_BIAS = 5
"""MultiHeadAttention's input index of attention_bias."""


def fold_padding_mask(model: onnx.ModelProto, padding_input: str = PADDING_INPUT) -> int:
    """Fold each com.microsoft.MultiHeadAttention's key-padding attention_bias into its query and
    key heads (in place; module docstring); returns how many nodes were rewritten."""
    graph = model.graph
    mask_input = next((value for value in graph.input if value.name == padding_input), None)
    if mask_input is None:
        return 0
    view = GraphView(graph)
    candidates = [node for node in graph.node if node.op_type == "MultiHeadAttention" and node.domain == MS_DOMAIN
                  and _only_a_bias(node) and _three_dimensional(view, node.input[0])
                  and _three_dimensional(view, node.input[1])]
    verdicts = {bias: is_key_padding_mask(model, view, _unexpanded(view, bias), mask_input)
                for bias in {node.input[_BIAS] for node in candidates}}
    chosen = [node for node in candidates if verdicts[node.input[_BIAS]]]
    if not chosen:
        return 0
    constants = Constants(graph)
    # The key column's nodes read only the graph input: they go first.
    new_nodes: list[onnx.NodeProto] = []
    key_column = _key_column(constants, new_nodes, padding_input)
    before = {id(node): _folded_heads(constants, node, key_column) for node in chosen}
    for node in graph.node:
        new_nodes.extend(before.get(id(node), []))
        new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)
    remove_unused(graph)
    return len(chosen)


def _only_a_bias(node: onnx.NodeProto) -> bool:
    """Self- or cross-attention with an attention_bias, its scale stated, and nothing else optional
    (no packed inputs, projection bias, key_padding_mask or past state)."""
    inputs = list(node.input) + [""] * (8 - len(node.input))
    # An explicit scale: the default, 1 / sqrt(head size), would change with the widened heads.
    return (all(inputs[:3]) and inputs[_BIAS] != "" and not any(inputs[3:5]) and not any(inputs[6:])
            and len(node.output) == 1 and not attribute_value(node, "unidirectional", 0)
            and bool(attribute_value(node, "scale", 0.0)))


def _unexpanded(view: GraphView, bias: str) -> str:
    """The tensor an Expand broadcast to `bias` (attention.py expands a [batch, 1, 1, keys] mask to
    the scores' shape, read from the queries and keys), else `bias` itself."""
    node = view.producer.get(bias)
    return node.input[0] if node is not None and node.op_type == "Expand" else bias


def _three_dimensional(view: GraphView, name: str) -> bool:
    """Whether `name` is known to be [batch, length, width]: a Reshape to a 3-element shape (what
    attention.py gives MultiHeadAttention), not the [batch, heads, length, head] a node may also take."""
    node = view.producer.get(name)
    shape = view.constant(node.input[1]) if node is not None and node.op_type == "Reshape" else None
    return shape is not None and shape.shape == (3,)


def is_key_padding_mask(model: onnx.ModelProto, view: GraphView, bias: str, mask_input: onnx.ValueInfoProto) -> bool:
    """Whether tensor `bias` is a key-padding mask of graph input `mask_input`: computed from it,
    small constants and the shapes of other [batch, length] inputs alone, and on every PROBE_MASKS 0
    where a key is kept and at most MASK_FILL_LIMIT where it is padding, the same for every head and
    query."""
    subgraph = _ancestors(view, bias, mask_input.name)
    if subgraph is None:
        return False
    nodes, constants, shaped = subgraph
    inputs = {value.name: value for value in view.graph.input}
    others = [inputs[name] for name in sorted(shaped)]
    if any(len(value.type.tensor_type.shape.dim) != 2 for value in others):
        return False  # exporters read a length from any input of the same symbolic shape: [batch, length] only
    probe = helper.make_model(
        helper.make_graph(nodes, "padding_mask_probe", [mask_input, *others],
                          [helper.make_tensor_value_info(bias, TensorProto.FLOAT, None)], constants),
        opset_imports=list(model.opset_import), ir_version=model.ir_version)
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
        for rows in PROBE_MASKS:
            mask = np.asarray(rows, dtype=bool)
            feed = {value.name: np.zeros(mask.shape, helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))
                    for value in others}
            feed[mask_input.name] = mask.astype(helper.tensor_dtype_to_np_dtype(mask_input.type.tensor_type.elem_type))
            (value,) = session.run(None, feed)
            if not _masks_keys(np.asarray(value), mask):
                return False
    except Exception:  # a subgraph ONNX Runtime cannot run alone: not a mask we can prove
        return False
    return True


def _masks_keys(bias: np.ndarray, mask: np.ndarray) -> bool:
    batch, keys = mask.shape
    if bias.ndim != 4 or bias.shape[0] != batch or bias.shape[3] != keys or bias.shape[2] not in (1, keys):
        return False
    per_key = bias[:, :1, :1, :]
    return bool(np.all(bias == per_key) and np.all(per_key[:, 0, 0][mask] == 0)
                and np.all(per_key[:, 0, 0][~mask] <= MASK_FILL_LIMIT))


def _ancestors(view: GraphView, name: str, mask_input: str
               ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], set[str]] | None:
    """(the nodes computing `name`, in graph order; the constants they read; the other graph inputs
    they read only the shape of), or None when they read another graph input's values, a large or
    external constant, or have subgraphs."""
    needed: set[int] = set()
    constants: dict[str, onnx.TensorProto] = {}
    shaped: set[str] = set()
    pending: list[tuple[str, bool]] = [(name, False)]
    seen: set[tuple[str, bool]] = set()
    while pending:
        tensor, shape_only = pending.pop()
        if (tensor, shape_only) in seen or not tensor:
            continue
        seen.add((tensor, shape_only))
        if tensor in view.initializers:
            init = view.initializers[tensor]
            if init.data_location == TensorProto.EXTERNAL or len(init.raw_data) > MAX_PROBED_CONSTANT_BYTES:
                return None
            constants[tensor] = init
            continue
        node = view.producer.get(tensor)
        if node is None:  # a graph input
            if tensor != mask_input:
                if not shape_only:
                    return None
                shaped.add(tensor)
            continue
        if any(attribute.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for attribute in node.attribute):
            return None
        needed.add(id(node))
        pending.extend((source, node.op_type == "Shape") for source in node.input)
    nodes = [node for node in view.graph.node if id(node) in needed]
    return nodes, list(constants.values()), shaped


def _node(constants: Constants, into: list[onnx.NodeProto], op: str, inputs: list[str], stem: str,
          **attributes) -> str:
    """Append one `op` node with a new output to `into`; its output's name."""
    output = constants.unique(stem)
    into.append(helper.make_node(op, inputs, [output], name=output, **attributes))
    return output


def _key_column(constants: Constants, into: list[onnx.NodeProto], padding_input: str) -> str:
    """[batch, keys, 1]: 0 for a token, FOLDED_MASK_VALUE for padding (read once for every layer;
    each node divides it by its own scale)."""
    keep = _node(constants, into, "Cast", [padding_input], "padding_keep", to=TensorProto.BOOL)
    zero = constants.get(np.array(0.0, dtype=np.float32), "padding_zero")
    fill = constants.get(np.array(FOLDED_MASK_VALUE, dtype=np.float32), "padding_fill")
    column = _node(constants, into, "Where", [keep, zero, fill], "padding_bias")
    axes = constants.get(np.array([2], dtype=np.int64), "padding_axes")
    return _node(constants, into, "Unsqueeze", [column, axes], "padding_bias_column")


def _folded_heads(constants: Constants, node: onnx.NodeProto, key_column: str) -> list[onnx.NodeProto]:
    """The nodes that give `node` (rewritten in place: no bias, widened query and key heads) its
    query heads with a last element 1 and its key heads with the key's bias / scale."""
    nodes: list[onnx.NodeProto] = []
    heads = int(attribute_value(node, "num_heads"))
    scale = float(attribute_value(node, "scale", 0.0))
    query, key = node.input[0], node.input[1]
    inverse_scale = constants.get(np.array(1.0 / scale, np.float32), "folded_inverse_scale")
    key_bias = _node(constants, nodes, "Mul", [key_column, inverse_scale], "folded_key_bias")
    split = constants.get(np.array([0, 0, heads, -1], dtype=np.int64), "folded_split")
    flat = constants.get(np.array([0, 0, -1], dtype=np.int64), "folded_flat")
    tail = constants.get(np.array([heads, 1], dtype=np.int64), "folded_tail")

    def widened(tensor: str, column: str, hint: str) -> str:
        rows = _node(constants, nodes, "Shape", [tensor], f"{hint}_rows", start=0, end=2)
        shape = _node(constants, nodes, "Concat", [rows, tail], f"{hint}_column_shape", axis=0)
        expanded = _node(constants, nodes, "Expand", [column, shape], f"{hint}_column")
        heads_4d = _node(constants, nodes, "Reshape", [tensor, split], f"{hint}_heads")
        joined = _node(constants, nodes, "Concat", [heads_4d, expanded], f"{hint}_widened_heads", axis=3)
        return _node(constants, nodes, "Reshape", [joined, flat], f"{hint}_widened")

    one = constants.get(np.ones((1, 1, 1, 1), dtype=np.float32), "folded_one")
    axis = constants.get(np.array([3], np.int64), "folded_axis")
    key_bias_4d = _node(constants, nodes, "Unsqueeze", [key_bias, axis], "folded_key_bias_4d")
    node.input[0] = widened(query, one, f"{node.name or 'mha'}_query")
    node.input[1] = widened(key, key_bias_4d, f"{node.name or 'mha'}_key")
    del node.input[3:]
    return nodes
