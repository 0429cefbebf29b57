"""A read-only view of an ONNX graph for the rewrites of this package: who produces and who
consumes each tensor, and the value of constant tensors.

    view = GraphView(model.graph)
    view.producer["scores"].op_type     # "MatMul"
    view.scalar("scale")                # 0.125, when a scalar constant

Built once per rewrite pass: a rewrite that changes the graph makes a new view. `remove_unused`
is the clean-up after a rewrite.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np
import onnx
from onnx import helper, numpy_helper


class GraphView:
    """Producer/consumer maps and constant lookup over a GraphProto (rebuilt after each rewrite)."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
        for node in graph.node:
            for name in node.output:
                self.producer[name] = node
            for name in node.input:
                if name:
                    self.consumers[name].append(node)
        self.initializers = {init.name: init for init in graph.initializer}
        self.outputs = {value.name for value in graph.output}

    def constant(self, name: str) -> np.ndarray | None:
        """The value of `name` if it is an initializer or a Constant node's output."""
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value":
                    return numpy_helper.to_array(attribute.t)
                if attribute.name == "value_float":
                    return np.array(attribute.f, dtype=np.float32)
                if attribute.name == "value_int":
                    return np.array(attribute.i, dtype=np.int64)
        return None

    def scalar(self, name: str) -> float | None:
        """The value of `name` if it is a floating-point constant with one element."""
        value = self.constant(name)
        if value is None or value.size != 1 or not np.issubdtype(value.dtype, np.floating):
            return None
        return float(value.reshape(()))

    def only_consumer(self, name: str) -> onnx.NodeProto | None:
        """The one node reading `name`, if exactly one does and `name` is not a graph output."""
        found = self.consumers.get(name, [])
        return found[0] if len(found) == 1 and name not in self.outputs else None


def attribute_value(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """The value of `node`'s attribute `name` (a Python int, float, list, ...), or `default`."""
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


def remove_unused(graph: onnx.GraphProto) -> None:
    """Drop nodes whose outputs nothing uses, and initializers nothing reads."""
    while True:
        used = {name for node in graph.node for name in node.input} | {value.name for value in graph.output}
        keep = [node for node in graph.node if any(name in used for name in node.output)]
        if len(keep) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(keep)
    used = {name for node in graph.node for name in node.input}
    unused = [init for init in graph.initializer if init.name not in used]
    for init in unused:
        graph.initializer.remove(init)



class Constants:
    """Names and initializers a rewrite adds: `unique(stem)` a name no tensor of the graph has yet,
    `get(value, stem)` an initializer holding `value`, added once per value."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.names = {init.name for init in graph.initializer} | {o for n in graph.node for o in n.output} | {
            i.name for i in graph.input}
        self.cache: dict[tuple, str] = {}

    def get(self, value: np.ndarray, stem: str) -> str:
        key = (value.dtype.str, value.shape, value.tobytes())
        if key not in self.cache:
            name = self.unique(stem)
            self.graph.initializer.append(numpy_helper.from_array(value, name))
            self.cache[key] = name
        return self.cache[key]

    def unique(self, stem: str) -> str:
        index = 0
        while f"{stem}_{index}" in self.names:
            index += 1
        name = f"{stem}_{index}"
        self.names.add(name)
        return name


class Matched(Protocol):
    """A subgraph a fusion found: `nodes` are those it replaces, the last where the fused ones go."""

    nodes: list[onnx.NodeProto]


M = TypeVar("M", bound=Matched)


def match_each(graph: onnx.GraphProto, anchor: str, match: Callable[[onnx.NodeProto], M | None]) -> list[M]:
    """`match(node)` for every node of type `anchor`, in graph order, keeping those that matched and
    share no node with an earlier match."""
    matches: list[M] = []
    claimed: set[int] = set()
    for node in graph.node:
        if node.op_type != anchor:
            continue
        found = match(node)
        if found is None or any(id(n) in claimed for n in found.nodes):
            continue
        claimed.update(id(n) for n in found.nodes)
        matches.append(found)
    return matches


def replace_matches(graph: onnx.GraphProto, matches: Sequence[M],
                    fused: Callable[[M], list[onnx.NodeProto]]) -> None:
    """Put `fused(match)` where each match's last node was, and drop the matches' nodes."""
    replaced = {id(n) for m in matches for n in m.nodes}
    by_last = {id(m.nodes[-1]): m for m in matches}
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if id(node) in by_last:
            new_nodes.extend(fused(by_last[id(node)]))
        elif id(node) not in replaced:
            new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)
