"""How N_encoder routes a request between its own graph and the graphs it hosts
(serving/hosted_graphs.HostedGraphs.graph_of): by the outputs the request names."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from bionemo_export.serving.hosted_graphs import HostedGraphs
from bionemo_export.serving.responses import RequestError

ENCODER = ["embeddings", "hiddens", "mask"]
HOSTED = {"layers": ["hiddens_0", "hiddens_1"], "contacts": ["contacts"], "attentions": ["attentions_0"]}


def _hosted(hosted: dict[str, list[str]] = HOSTED) -> HostedGraphs:
    served = [*ENCODER, *(output for outputs in hosted.values() for output in outputs)]
    return HostedGraphs({name: cast(Any, SimpleNamespace(outputs=outputs)) for name, outputs in hosted.items()}, served)


def _asking(*outputs: str) -> Any:
    return SimpleNamespace(requested_output_names=lambda: list(outputs))


@pytest.mark.parametrize(("outputs", "graph"), [
    (["embeddings"], None),
    (["hiddens", "mask"], None),
    (["hiddens_1"], "layers"),
    (["hiddens_0", "hiddens_1"], "layers"),
    (["contacts"], "contacts"),
    (["attentions_0"], "attentions"),
    # No outputs named: Triton lists every output of the config; the encoder answers its own.
    ([*ENCODER, *(o for outputs in HOSTED.values() for o in outputs)], None),
])
def test_a_request_goes_to_the_graph_of_the_outputs_it_names(outputs, graph):
    assert _hosted().graph_of(_asking(*outputs)) == graph


def test_every_output_of_the_one_hosted_graph_is_that_graphs_request():
    """MegaMolBART's N_encoder hosts the layers graph alone: N_layers asks all its outputs (found
    by CI: routed to the encoder as a request naming none, which has no `sequences`)."""
    hosted = _hosted({"layers": ["hiddens_0", "hiddens_1"]})
    assert hosted.graph_of(_asking("hiddens_0", "hiddens_1")) == "layers"
    assert hosted.graph_of(_asking(*ENCODER, "hiddens_0", "hiddens_1")) is None


@pytest.mark.parametrize("outputs", [["hiddens_0", "contacts"], ["embeddings", "contacts"],
                                     ["mask", "hiddens_0", "attentions_0"]])
def test_outputs_of_two_graphs_in_one_request_are_refused_naming_them(outputs):
    with pytest.raises(RequestError, match="come from different graphs") as refused:
        _hosted().graph_of(_asking(*outputs))
    assert all(name in str(refused.value) for name in outputs)
