"""Attention fusion: each decomposed attention subgraph of an exported graph becomes one
`com.microsoft.MultiHeadAttention` node.

    fused = fuse_attention(model, num_heads=8)   # in place; how many subgraphs were fused

Exporters decompose attention into MatMul, scaling, a mask (Add or Where), Softmax, a NaN guard
(torch.onnx's scaled_dot_product_attention) and a second MatMul, each a pass over a [batch, heads,
length, length] tensor. The subgraph becomes one MultiHeadAttention node with the same scale and
the same additive mask (`attention_bias`), whatever produced the queries and keys (BERT's
projections, ESM-2's rotary embeddings, the project's own transformer). ONNX Runtime's transformer
optimizer fuses none of these (0 Attention nodes on the dynamo-exported BERT and ESM-2 graphs,
onnxruntime 1.31): it expects older exporters' masks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from .graph import Constants, GraphView, attribute_value, match_each, remove_unused, replace_matches

MS_DOMAIN = "com.microsoft"
MASK_FILL_LIMIT = -1e4
"""A Where-mask fill value at or below this is a "masked out" score (finfo.min, -inf, -1e4)."""


@dataclass
class _Match:
    """One attention subgraph: softmax(q @ k^T * scale + bias) @ v."""

    query: str
    key: str
    key_layout: str
    """"bnsh" ([batch, heads, length, head]) or "bsnh" ([batch, length, heads, head])."""
    value: str
    bias: str | None
    """An additive float mask, broadcastable to [batch, heads, queries, keys]; None: no mask."""
    where_mask: tuple[str, float, bool] | None
    """(condition, fill, fill_when_true) when the mask is a Where on the scores."""
    scale: float
    output: str
    nodes: list[onnx.NodeProto]
    """The nodes the fused node replaces (their outputs feed only each other)."""


def fuse_attention(model: onnx.ModelProto, num_heads: int) -> int:
    """Replace every attention subgraph of `model` (in place) by a com.microsoft.MultiHeadAttention
    node; returns how many were fused. Subgraphs whose intermediate values are used elsewhere, or
    whose scale is not a constant, are left alone."""
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 15:  # the fused subgraph uses Shape(start, end), opset 15
        return 0
    view = GraphView(graph)
    matches = match_each(graph, "Softmax", lambda node: _match_attention(view, node))
    if not matches:
        return 0
    if not any(opset.domain == MS_DOMAIN for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    constants = Constants(graph)
    # each fused node goes where the subgraph's final MatMul was
    replace_matches(graph, matches, lambda match: _fused_nodes(match, num_heads, constants, view))
    _cancel_transposes(graph)
    remove_unused(graph)
    return len(matches)


def _match_attention(view: GraphView, softmax: onnx.NodeProto) -> _Match | None:
    axis = attribute_value(softmax, "axis", -1)
    if axis not in (-1, 3):
        return None
    nodes = [softmax]
    probabilities = softmax.output[0]
    # torch.onnx's SDPA: Where(IsNaN(p), 0, p) after the softmax.
    consumers = view.consumers.get(probabilities, [])
    if probabilities in view.outputs:
        return None
    if len(consumers) == 2 and {c.op_type for c in consumers} == {"IsNaN", "Where"}:
        isnan = next(c for c in consumers if c.op_type == "IsNaN")
        where = next(c for c in consumers if c.op_type == "Where")
        if (view.only_consumer(isnan.output[0]) is not where or where.input[0] != isnan.output[0]
                or where.input[2] != probabilities or view.scalar(where.input[1]) != 0.0):
            return None
        nodes += [isnan, where]
        probabilities = where.output[0]
    final = view.only_consumer(probabilities)
    if final is None or final.op_type != "MatMul" or final.input[0] != probabilities:
        return None
    value = final.input[1]

    # Softmax input: scores (+ bias | Where mask | nothing).
    scores_name = softmax.input[0]
    bias = where_mask = None
    producer = view.producer.get(scores_name)
    if producer is None or view.only_consumer(scores_name) is not softmax:
        return None
    if producer.op_type == "Add":
        scored = [name for name in producer.input if _leads_to_matmul(view, name)]
        if len(scored) != 1:
            return None
        bias = next(name for name in producer.input if name != scored[0])
        nodes.append(producer)
        scores_name = scored[0]
    elif producer.op_type == "Where":
        condition, when_true, when_false = producer.input
        fill_true, fill_false = view.scalar(when_true), view.scalar(when_false)
        if fill_true is not None and fill_true <= MASK_FILL_LIMIT and _leads_to_matmul(view, when_false):
            where_mask, scores_name = (condition, fill_true, True), when_false
        elif fill_false is not None and fill_false <= MASK_FILL_LIMIT and _leads_to_matmul(view, when_true):
            where_mask, scores_name = (condition, fill_false, False), when_true
        else:
            return None
        nodes.append(producer)
    elif not _leads_to_matmul(view, scores_name):
        return None
    if scores_name != softmax.input[0] and view.only_consumer(scores_name) is None:
        return None

    # Scores: [Mul|Div by a constant] of MatMul(q', k'^T).
    scale = 1.0
    producer = view.producer[scores_name]
    if producer.op_type in ("Mul", "Div"):
        factor = _scale_of(view, producer)
        if factor is None:
            return None
        scale *= factor[0]
        nodes.append(producer)
        scores_name = factor[1]
        producer = view.producer.get(scores_name)
        if producer is None or view.only_consumer(scores_name) is None:
            return None
    if producer.op_type != "MatMul":
        return None
    nodes.append(producer)
    query, key_transposed = producer.input
    query, factor = _unscaled(view, query, nodes)
    scale *= factor
    key_transposed, factor = _unscaled(view, key_transposed, nodes)
    scale *= factor
    found = _untransposed_key(view, key_transposed, nodes)
    if found is None or not math.isfinite(scale) or scale == 0.0:
        return None
    key, key_layout = found
    nodes.append(final)  # last: the node the fused ones take the place of
    # Every intermediate value must feed only the subgraph.
    inside = {id(n) for n in nodes}
    for node in nodes[:-1]:
        for name in node.output:
            if name in view.outputs or any(id(c) not in inside for c in view.consumers.get(name, [])):
                return None
    return _Match(query, key, key_layout, value, bias, where_mask, scale, final.output[0], nodes)


def _leads_to_matmul(view: GraphView, name: str) -> bool:
    """Whether `name` is a MatMul output, directly or through one Mul/Div by a constant."""
    producer = view.producer.get(name)
    if producer is None:
        return False
    if producer.op_type in ("Mul", "Div"):
        factor = _scale_of(view, producer)
        producer = view.producer.get(factor[1]) if factor else None
    return producer is not None and producer.op_type == "MatMul"


def _scale_of(view: GraphView, node: onnx.NodeProto) -> tuple[float, str] | None:
    """(factor, the other input) when `node` is Mul/Div of a tensor by a scalar constant."""
    first, second = node.input
    if node.op_type == "Div":
        divisor = view.scalar(second)
        return (1.0 / divisor, first) if divisor else None
    for constant, other in ((first, second), (second, first)):
        factor = view.scalar(constant)
        if factor is not None:
            return factor, other
    return None


def _unscaled(view: GraphView, name: str, nodes: list[onnx.NodeProto]) -> tuple[str, float]:
    """`name` without a Mul/Div by a scalar constant (recorded in `nodes`), and that factor; `name`
    itself (factor 1) when it is not scaled or its scaled value is used elsewhere too."""
    producer = view.producer.get(name)
    if producer is not None and producer.op_type in ("Mul", "Div"):
        factor = _scale_of(view, producer)
        if factor is not None and view.only_consumer(name) is not None:
            nodes.append(producer)
            return factor[1], factor[0]
    return name, 1.0


def _untransposed_key(view: GraphView, name: str, nodes: list[onnx.NodeProto]) -> tuple[str, str] | None:
    """(keys, layout) for the transposed keys `name` ([batch, heads, head, length]): a Transpose
    with perm [0, 1, 3, 2] of [batch, heads, length, head] keys ("bnsh"), a Transpose with perm
    [0, 2, 3, 1] of [batch, length, heads, head] keys ("bsnh", the TorchScript exporter), or
    torch.onnx's Reshape -> Transpose([0, 2, 1]) -> Reshape with shapes from Shape(keys) ("bnsh",
    the dynamo exporter)."""
    producer = view.producer.get(name)
    if producer is None or view.only_consumer(name) is None:
        return None
    if producer.op_type == "Transpose":
        layout = {(0, 1, 3, 2): "bnsh", (0, 2, 3, 1): "bsnh"}.get(tuple(attribute_value(producer, "perm", ())))
        if layout is None:
            return None
        nodes.append(producer)
        return producer.input[0], layout
    if producer.op_type != "Reshape":
        return None
    transpose = view.producer.get(producer.input[0])
    if (transpose is None or transpose.op_type != "Transpose"
            or list(attribute_value(transpose, "perm", [])) != [0, 2, 1]):
        return None
    first = view.producer.get(transpose.input[0])
    if first is None or first.op_type != "Reshape" or view.only_consumer(transpose.input[0]) is None:
        return None
    key = first.input[0]
    # Both target shapes must come from Shape(key) (and constants) only.
    for shape_input in (first.input[1], producer.input[1]):
        shapes = _shape_sources(view, shape_input)
        if not shapes or any(source != key for source in shapes):
            return None
    if view.only_consumer(transpose.output[0]) is None:
        return None
    nodes += [producer, transpose, first]
    return key, "bnsh"


def _shape_sources(view: GraphView, name: str, depth: int = 4) -> set[str] | None:
    """The tensors whose Shape feeds the shape tensor `name` through Slice/Concat/Gather/Unsqueeze
    and constants; None when something else does."""
    if view.constant(name) is not None:
        return set()
    producer = view.producer.get(name)
    if producer is None or depth == 0:
        return None
    if producer.op_type == "Shape":
        return {producer.input[0]}
    if producer.op_type not in ("Slice", "Concat", "Gather", "Unsqueeze", "Squeeze"):
        return None
    sources: set[str] = set()
    data_inputs = producer.input if producer.op_type == "Concat" else producer.input[:1]
    for data in data_inputs:
        found = _shape_sources(view, data, depth - 1)
        if found is None:
            return None
        sources |= found
    for index in producer.input[1:] if producer.op_type != "Concat" else ():
        if index and view.constant(index) is None:
            return None
    return sources


def _fused_nodes(match: _Match, num_heads: int, constants: Constants, view: GraphView) -> list[onnx.NodeProto]:
    """MultiHeadAttention over [batch, length, heads * head] views of q, k, v, its output turned
    back into [batch, heads, length, head] under the original output name."""
    nodes: list[onnx.NodeProto] = []
    flat = constants.get(np.array([0, 0, -1], dtype=np.int64), "mha_flat_shape")
    split = constants.get(np.array([0, 0, num_heads, -1], dtype=np.int64), "mha_split_shape")
    perm = [0, 2, 1, 3]

    def to_bsd(name: str, layout: str = "bnsh") -> str:
        flattened = constants.unique(f"{name}_bsd")
        if layout == "bnsh":
            transposed = constants.unique(f"{name}_bsnh")
            nodes.append(helper.make_node("Transpose", [name], [transposed], perm=perm, name=transposed))
            name = transposed
        nodes.append(helper.make_node("Reshape", [name, flat], [flattened], name=flattened))
        return flattened

    query, key, value = to_bsd(match.query), to_bsd(match.key, match.key_layout), to_bsd(match.value)
    bias = match.bias or ""
    if match.where_mask is not None:
        condition, fill, fill_when_true = match.where_mask
        zero = constants.get(np.array(0.0, dtype=np.float32), "mha_zero")
        filled = constants.get(np.array(fill, dtype=np.float32), "mha_fill")
        bias = constants.unique(f"{match.output}_attention_bias")
        inputs = [condition, filled, zero] if fill_when_true else [condition, zero, filled]
        nodes.append(helper.make_node("Where", inputs, [bias], name=bias))
    if bias:
        # MultiHeadAttention takes attention_bias [batch or 1, heads or 1, queries, keys]: expand a
        # bias broadcast over queries (e.g. [batch, 1, 1, keys]) to that shape.
        bias = _expanded_bias(bias, match, nodes, constants)
    fused_out = constants.unique(f"{match.output}_mha")
    nodes.append(helper.make_node(
        "MultiHeadAttention", [query, key, value, "", "", bias], [fused_out], domain=MS_DOMAIN,
        num_heads=num_heads, scale=float(match.scale), name=fused_out))
    split_out = constants.unique(f"{match.output}_bsnh")
    nodes.append(helper.make_node("Reshape", [fused_out, split], [split_out], name=split_out))
    nodes.append(helper.make_node("Transpose", [split_out], [match.output], perm=perm,
                                  name=constants.unique(f"{match.output}_bnsh")))
    return nodes


def _expanded_bias(bias: str, match: _Match, nodes: list[onnx.NodeProto], constants: Constants) -> str:
    """Expand(bias, [shape(bias)[0], shape(bias)[1], queries, keys]) with queries and keys read
    from the query and key tensors ([batch, heads, length, head])."""
    def shape_slice(source: str, start: int, end: int) -> str:
        shape = constants.unique(f"{source}_shape")
        nodes.append(helper.make_node("Shape", [source], [shape], start=start, end=end, name=shape))
        return shape

    leading = shape_slice(bias, 0, 2)
    queries = shape_slice(match.query, 2, 3)
    keys = shape_slice(match.key, *((2, 3) if match.key_layout == "bnsh" else (1, 2)))
    target = constants.unique(f"{bias}_target")
    nodes.append(helper.make_node("Concat", [leading, queries, keys], [target], axis=0, name=target))
    expanded = constants.unique(f"{bias}_expanded")
    nodes.append(helper.make_node("Expand", [bias, target], [expanded], name=expanded))
    return expanded


def _cancel_transposes(graph: onnx.GraphProto) -> None:
    """Transpose(Transpose(x, p), q) with q∘p the identity -> x, for every consumer."""
    view = GraphView(graph)
    rename: dict[str, str] = {}
    for node in graph.node:
        if node.op_type != "Transpose":
            continue
        inner = view.producer.get(node.input[0])
        if inner is None or inner.op_type != "Transpose":
            continue
        outer_perm, inner_perm = attribute_value(node, "perm"), attribute_value(inner, "perm")
        if outer_perm is None or inner_perm is None or len(outer_perm) != len(inner_perm):
            continue
        if [inner_perm[axis] for axis in outer_perm] == list(range(len(outer_perm))):
            if node.output[0] not in view.outputs:
                rename[node.output[0]] = inner.input[0]
    if not rename:
        return
    def resolve(name: str) -> str:
        while name in rename:
            name = rename[name]
        return name
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name in rename:
                node.input[index] = resolve(name)
