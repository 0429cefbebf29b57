"""Rotary embedding fusion: each decomposed rotary position embedding of an exported graph becomes
one `com.microsoft.RotaryEmbedding` node.

    fused = fuse_rotary(model)   # in place; how many subgraphs (one per query, one per key) were fused

Hugging Face's ESM-2 and ESM C rotate queries and keys with `x * cos + rotate_half(x) * sin`, which
torch.onnx exports as two Slices, a Neg, a Concat, two Muls and an Add per tensor, each a pass over
[batch, heads, length, head]: ~80 ms of ONNX Runtime's ~910 ms on a stored int8 ESM-2 150M graph
(8 x 256 tokens, 2 threads, onnxruntime 1.32), ~14 ms fused; the same in fp32 (of ~1870 ms). The
fused node reads the [batch, length, heads * head] projection itself, before the exporter's Reshape
and Transpose, which are rebuilt after it: the Transpose then cancels the one attention fusion
(attention.py) puts before MultiHeadAttention, and a query scale that the model applies before the
rotation (ESM-2's 1/sqrt(head)) moves after it, where the attention fusion takes it into
MultiHeadAttention's scale. The rotation is linear, so that move changes only float rounding.

What is matched, exactly (anything else is left as it is):

* `Add(Mul(x, cos), Mul(Concat(Neg(Slice(x, h:)), Slice(x, 0:h)), sin))` (either operand order of
  the Add and Muls), the Slices and Concat on the last axis, step 1, the second Slice to the end;
* `x = [Mul(t, scalar constant)] of Transpose(z, perm [0, 2, 1, 3])`: z is [batch, length, heads,
  head] and x [batch, heads, length, head]; every value between z and the Add read only by the
  subgraph;
* `cos = Unsqueeze(Cos(Concat(f, f)))`, `sin = Unsqueeze(Sin(Concat(f, f)))` of one Concat, with
  `f = Mul([Cast to float] of Unsqueeze(Range(...)), inverse frequencies)`: the inverse frequencies
  a float32 constant of h values, and the Unsqueezes such that cos and sin are [1, 1, length, 2h]
  (axes [0, 2] then [1], or [1] then [0, 1]). cos and sin then depend on the token's position only
  and their two halves are equal, which is what RotaryEmbedding computes with a [length, h] cache
  indexed by position (position_ids [0]: positions 0, 1, ... of the input's length axis).

Head size 2h is then the rotated width (cos broadcasts against x's last axis), so the node needs no
head count: it reads its head size from the cache (rotary_embedding_dim 0: the whole head).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from bionemo_export.exporters.external_data import unloaded

from .attention import MS_DOMAIN
from .graph import Constants, GraphView, attribute_value, match_each, remove_unused, replace_matches

SLICE_TO_END = 2**31 - 1
"""A Slice end at or past this reads to the end of the axis (torch.onnx writes INT64_MAX)."""


@dataclass
class _Match:
    """One rotary subgraph: rotate(x) with x = [scale *] Transpose(source)."""

    source: str
    """z: [batch, length, heads, head], the Transpose's input."""
    scale: str | None
    """The scalar constant x is multiplied by before the rotation; None: not scaled."""
    frequencies: str
    """f: [1, length, h] or [length, h] angles, position times inverse frequency."""
    half: int
    """h: half the head size."""
    output: str
    nodes: list[onnx.NodeProto]
    """The nodes replaced (the Add last), their outputs read only by each other."""


def fuse_rotary(model: onnx.ModelProto) -> int:
    """Replace every rotary embedding subgraph of `model` (in place) by a com.microsoft.RotaryEmbedding
    node; returns how many were fused. A subgraph that differs from the module docstring's pattern in
    any way, or whose intermediate values are read elsewhere, is left alone."""
    graph = model.graph
    view = GraphView(graph)
    matches = match_each(graph, "Neg", lambda node: _match_rotary(view, node))
    if not matches:
        return 0
    if not any(opset.domain == MS_DOMAIN for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    constants = Constants(graph)
    caches: dict[str, tuple[str, str]] = {}
    replace_matches(graph, matches, lambda match: _fused_nodes(match, constants, caches))
    remove_unused(graph)
    return len(matches)


def _match_rotary(view: GraphView, neg: onnx.NodeProto) -> _Match | None:
    """The subgraph around `neg` (rotate_half's negation of the second half), or None."""
    concat = view.only_consumer(neg.output[0])
    if (concat is None or concat.op_type != "Concat" or len(concat.input) != 2 or concat.input[0] != neg.output[0]
            or attribute_value(concat, "axis") not in (-1, 3)):
        return None
    second, first = view.producer.get(neg.input[0]), view.producer.get(concat.input[1])
    if second is None or first is None or second.op_type != "Slice" or first.op_type != "Slice":
        return None
    x = first.input[0]
    bounds_first, bounds_second = _last_axis_slice(view, first), _last_axis_slice(view, second)
    if second.input[0] != x or bounds_first is None or bounds_second is None:
        return None
    if view.only_consumer(first.output[0]) is not concat or view.only_consumer(second.output[0]) is not neg:
        return None
    half = bounds_first[1]
    if bounds_first[0] != 0 or half <= 0 or bounds_second[0] != half or bounds_second[1] < 2 * half:
        return None
    sin_mul = view.only_consumer(concat.output[0])
    if sin_mul is None or sin_mul.op_type != "Mul":
        return None
    sin = _other_input(sin_mul, concat.output[0])
    add = view.only_consumer(sin_mul.output[0])
    if sin is None or add is None or add.op_type != "Add":
        return None
    cos_product = _other_input(add, sin_mul.output[0])
    if cos_product is None or view.only_consumer(cos_product) is not add:
        return None
    cos_mul = view.producer.get(cos_product)
    if cos_mul is None or cos_mul.op_type != "Mul":
        return None
    cos = _other_input(cos_mul, x)
    if cos is None:
        return None
    frequencies = _frequencies(view, cos, sin, half)
    if frequencies is None:
        return None
    nodes = [first, second, neg, concat, sin_mul, cos_mul]
    # x: read by the rotation only; [scale *] Transpose([0, 2, 1, 3]) of [batch, length, heads, head].
    if {id(c) for c in view.consumers.get(x, [])} != {id(first), id(second), id(cos_mul)} or x in view.outputs:
        return None
    scale = None
    producer = view.producer.get(x)
    if producer is not None and producer.op_type == "Mul":
        constant = next((name for name in producer.input if _small_scalar(view, name) is not None), None)
        scaled = _other_input(producer, constant) if constant else None
        if constant is None or scaled is None or view.only_consumer(scaled) is not producer:
            return None
        scale = constant
        nodes.append(producer)
        producer = view.producer.get(scaled)
    if (producer is None or producer.op_type != "Transpose"
            or list(attribute_value(producer, "perm", [])) != [0, 2, 1, 3]):
        return None
    nodes += [producer, add]  # the Add last: the node the fused ones take the place of
    return _Match(producer.input[0], scale, frequencies, half, add.output[0], nodes)


def _other_input(node: onnx.NodeProto, name: str) -> str | None:
    """The input of the two-input `node` that is not `name` (None when `name` is not one of them)."""
    if len(node.input) != 2 or name not in node.input:
        return None
    first, second = node.input
    return second if first == name else first


def _small_constant(view: GraphView, name: str) -> np.ndarray | None:
    """The value of `name` when a constant held in the graph (weights left in their file are
    not read: nothing matched here is one)."""
    initializer = view.initializers.get(name)
    if initializer is not None and unloaded(initializer):
        return None
    return view.constant(name)


def _small_scalar(view: GraphView, name: str) -> float | None:
    value = _small_constant(view, name)
    if value is None or value.size != 1 or not np.issubdtype(value.dtype, np.floating):
        return None
    return float(value.reshape(()))


def _ints(view: GraphView, name: str) -> list[int] | None:
    value = _small_constant(view, name) if name else None
    if value is None or not np.issubdtype(value.dtype, np.integer):
        return None
    return [int(v) for v in value.reshape(-1)]


def _last_axis_slice(view: GraphView, node: onnx.NodeProto) -> tuple[int, int] | None:
    """(start, end) when `node` slices the last axis of a 4-D tensor with step 1; None otherwise."""
    if len(node.input) < 4:
        return None
    starts, ends, axes = _ints(view, node.input[1]), _ints(view, node.input[2]), _ints(view, node.input[3])
    steps = _ints(view, node.input[4]) if len(node.input) > 4 and node.input[4] else [1]
    if starts is None or ends is None or axes not in ([3], [-1]) or steps != [1] or len(starts) != 1 or len(ends) != 1:
        return None
    if starts[0] < 0 or ends[0] < 0:
        return None
    return starts[0], (SLICE_TO_END if ends[0] >= SLICE_TO_END else ends[0])


def _frequencies(view: GraphView, cos: str, sin: str, half: int) -> str | None:
    """f when `cos` and `sin` are [1, 1, length, 2 * half] Unsqueeze(Cos|Sin(Concat(f, f))) of one
    f = positions x inverse frequencies (module docstring); None otherwise."""
    cos_unsqueeze, sin_unsqueeze = view.producer.get(cos), view.producer.get(sin)
    if cos_unsqueeze is None or sin_unsqueeze is None:
        return None
    if cos_unsqueeze.op_type != "Unsqueeze" or sin_unsqueeze.op_type != "Unsqueeze":
        return None
    outer_axes = _ints(view, cos_unsqueeze.input[1]) if len(cos_unsqueeze.input) > 1 else None
    if outer_axes is None or outer_axes != _ints(view, sin_unsqueeze.input[1]):
        return None
    cos_node, sin_node = view.producer.get(cos_unsqueeze.input[0]), view.producer.get(sin_unsqueeze.input[0])
    if cos_node is None or sin_node is None or cos_node.op_type != "Cos" or sin_node.op_type != "Sin":
        return None
    if cos_node.input[0] != sin_node.input[0]:
        return None
    doubled = view.producer.get(cos_node.input[0])
    if (doubled is None or doubled.op_type != "Concat" or len(doubled.input) != 2
            or doubled.input[0] != doubled.input[1]):
        return None
    frequencies = doubled.input[0]
    product = view.producer.get(frequencies)
    if product is None or product.op_type != "Mul":
        return None
    inverse = next((name for name in product.input if _small_constant(view, name) is not None), None)
    positions = _other_input(product, inverse) if inverse else None
    values = _small_constant(view, inverse) if inverse else None
    if positions is None or values is None or values.dtype != np.float32 or values.shape != (half,):
        return None
    cast = view.producer.get(positions)
    if cast is not None and cast.op_type == "Cast":
        if attribute_value(cast, "to") != onnx.TensorProto.FLOAT:
            return None
        cast = view.producer.get(cast.input[0])
    if cast is None or cast.op_type != "Unsqueeze" or len(cast.input) < 2:
        return None
    inner_axes = _ints(view, cast.input[1])
    source = view.producer.get(cast.input[0])
    if source is None or source.op_type != "Range":  # a Range is 1-D: [length]
        return None
    # [length] -> f [1, length, h] -> cos [1, 1, length, 2h], or f [length, h] -> [1, 1, length, 2h];
    # the Concat joins the last axis.
    layouts = {(0, 2): ([1], (-1, 2)), (1,): ([0, 1], (-1, 1))}
    layout = layouts.get(tuple(inner_axes or ()))
    if layout is None or outer_axes != layout[0] or attribute_value(doubled, "axis") not in layout[1]:
        return None
    return frequencies


def _fused_nodes(match: _Match, constants: Constants, caches: dict[str, tuple[str, str]]) -> list[onnx.NodeProto]:
    """RotaryEmbedding over the [batch, length, heads * head] view of the source, then the
    exporter's Transpose (and scale) again, under the original output name. The first subgraph of
    each frequencies tensor also computes its caches (it comes after the frequencies' producer)."""
    nodes: list[onnx.NodeProto] = []
    if match.frequencies not in caches:
        caches[match.frequencies] = _caches(match, constants, nodes)
    cos_cache, sin_cache = caches[match.frequencies]
    flat = constants.get(np.array([0, 0, -1], dtype=np.int64), "rotary_flat_shape")
    heads = constants.get(np.array([0, 0, -1, 2 * match.half], dtype=np.int64), "rotary_heads_shape")
    start = constants.get(np.array([0], dtype=np.int64), "rotary_start")
    stem = match.output
    flattened, rotated, split = (constants.unique(f"{stem}_{suffix}") for suffix in ("bsd", "rotary", "bsnh"))
    nodes.append(helper.make_node("Reshape", [match.source, flat], [flattened], name=flattened))
    # interleaved 0: rotate_half's halves; num_heads and rotary_embedding_dim 0: the head size is
    # the cache's width times 2, the whole head (module docstring).
    nodes.append(helper.make_node("RotaryEmbedding", [flattened, start, cos_cache, sin_cache], [rotated],
                                  domain=MS_DOMAIN, interleaved=0, name=rotated))
    nodes.append(helper.make_node("Reshape", [rotated, heads], [split], name=split))
    transposed = constants.unique(f"{stem}_bnsh") if match.scale else match.output
    nodes.append(helper.make_node("Transpose", [split], [transposed], perm=[0, 2, 1, 3],
                                  name=constants.unique(f"{stem}_bnsh_transpose")))
    if match.scale:
        nodes.append(helper.make_node("Mul", [transposed, match.scale], [match.output],
                                      name=constants.unique(f"{stem}_scaled")))
    return nodes


def _caches(match: _Match, constants: Constants, nodes: list[onnx.NodeProto]) -> tuple[str, str]:
    """The [length, h] cos and sin caches of `match.frequencies` (their nodes added to `nodes`):
    the first half of the subgraph's cos and sin, whose two halves are equal."""
    rows = constants.get(np.array([-1, match.half], dtype=np.int64), "rotary_cache_shape")
    angles, cos, sin = (constants.unique(f"{match.frequencies}_{suffix}") for suffix in ("rows", "cos", "sin"))
    nodes.append(helper.make_node("Reshape", [match.frequencies, rows], [angles], name=angles))
    nodes.append(helper.make_node("Cos", [angles], [cos], name=cos))
    nodes.append(helper.make_node("Sin", [angles], [sin], name=sin))
    return cos, sin
