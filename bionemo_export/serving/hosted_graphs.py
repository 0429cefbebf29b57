"""The graphs N_encoder serves besides its own (model_repository/hosted_graphs.py): the layers,
contacts and attentions graphs, opened from the encoder's version folder over one weights file.

A request that asks for one of their outputs (hiddens_3, contacts, attentions_2, ...) is theirs:
its `input_ids` and `attention_mask` [rows, T] are checked (graph_model.GraphInputs) and run on the
graph that answers those outputs, fetching only them; every other request is the encoder's. The
sessions do not prepack their weights (onnx_session.py), so they compute from the memory-mapped
weights file: every session and every instance process on the host shares its pages.

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library, numpy and its sibling modules (the sessions are opened by onnx_session).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .graph_model import GraphInputs, GraphModel
from .parameters import tensor_names
from .responses import RequestError, Responder

HOSTED_GRAPHS = "hosted_graphs"
"""The config parameter naming them (model_repository/hosted_graphs.py writes it)."""
TOKEN_INPUTS = ("input_ids", "attention_mask")

Execute = Callable[[Sequence[Any]], tuple[list, int]]


class HostedGraphs:
    """Each hosted graph's GraphModel, by the outputs it answers."""

    def __init__(self, graphs: Mapping[str, GraphModel], served: Sequence[str] = ()) -> None:
        self.graphs = dict(graphs)
        self.by_output = {output: name for name, graph in self.graphs.items() for output in graph.outputs}
        self.served = frozenset(served)
        """Every output of the model's config (a request naming none is asked all of them)."""

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(self.by_output)

    @classmethod
    def open(cls, args: Mapping[str, str], parameters: Mapping[str, str], responder: Responder,
             open_session: Callable[[str, str], Any]) -> HostedGraphs:
        """The graphs the config's HOSTED_GRAPHS parameter lists (none: an empty HostedGraphs),
        each session opened by `open_session(graph file, optimization level)`."""
        listed = json.loads(parameters.get(HOSTED_GRAPHS) or "{}")
        if not listed:
            return cls({})
        checks = GraphInputs.from_parameters(args, parameters)
        graphs = {name: GraphModel(open_session(entry["file"], entry["graph_optimization_level"]), TOKEN_INPUTS,
                                   entry["outputs"], checks, responder)
                  for name, entry in listed.items()}
        return cls(graphs, tensor_names(args, "output"))

    def graph_of(self, request: Any) -> str | None:
        """The hosted graph answering what `request` asks for; None: the encoder's request. A
        request naming no outputs is the encoder's, as before N_encoder hosted graphs: Triton
        then lists every output of the config, and it gets the encoder's (found by the tests of
        internal models' errors, whose requests name none). A request asking outputs of two hosted
        graphs, or of a hosted graph and the encoder, is an error naming them."""
        requested = list(request.requested_output_names())
        mine = {self.by_output[name] for name in requested if name in self.by_output}
        if not mine or (self.served and self.served <= set(requested)):
            return None
        if len(mine) > 1 or len(mine) < len({self.by_output.get(name) for name in requested}):
            raise RequestError(f"outputs {', '.join(requested)} come from different graphs ({', '.join(sorted(mine))} "
                               "and the encoder's): ask each graph's outputs in a request of its own")
        return mine.pop()

    def serve(self, requests: Sequence[Any], encoder: Execute, responder: Responder) -> tuple[list, int]:
        """(one response per request, bytes of work): each hosted graph's requests run on it, the
        others go to `encoder` together (its batching joins them), the answers in request order."""
        if not self.graphs:
            return encoder(requests)
        responses: list[Any] = [None] * len(requests)
        groups: dict[str | None, list[int]] = {}
        for index, request in enumerate(requests):
            try:
                groups.setdefault(self.graph_of(request), []).append(index)
            except RequestError as err:
                responses[index] = responder.error_response(err)
        work = 0
        for name, indices in groups.items():
            execute = encoder if name is None else self.graphs[name].execute
            answered, used = execute([requests[i] for i in indices])
            work = max(work, used)
            for index, response in zip(indices, answered):
                responses[index] = response
        return responses, work
