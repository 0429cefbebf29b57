"""The encoder's model serves the graphs that are the encoder again (Python backend), over one
copy of the weights.

The layers, contacts and attentions graphs hold the encoder's weights (other outputs; eager
attention where probabilities are answered). With `--backend python` the build writes them beside
the encoder's graph, all four over one weights file (exporters/shared_weights.py), and the planners'
graph models (N_layer_graph, N_contact_graph, N_attention_graph) are folded into N_encoder:

    N_encoder  python  as encoder.py plans it, and besides: input_ids, attention_mask INT64 [-1]
                       (optional) -> each hosted graph's outputs (hiddens_0 .. hiddens_N, contacts,
                       attentions_1 .. attentions_N), one row per batch row, only those a request asks
                       for (serving/hosted_graphs.py runs the request on the graph that answers them)

so that one model folder holds the weights: Triton downloads each model folder of an s3://
repository on its own, and ONNX Runtime refuses external data outside the graph's folder, so the
graphs that share a file must share a folder. The callers (N_layers, N_contacts, N_attentions)
call N_encoder through BLS, their `graph_model` parameter naming it.

Config parameters of N_encoder (JSON): HOSTED_GRAPHS, each hosted graph's file and outputs;
SHARED_WEIGHTS, the weights file's name, size and sha256, which consistency.py checks the folder
against. Native (onnxruntime_onnx) and TensorRT models run one graph per model folder: there the
graphs keep models of their own, each with its own copy of the weights (build.py leaves those tasks
out of a default build).
"""

from __future__ import annotations

import json
from pathlib import Path

from bionemo_export.digests import file_digest
from bionemo_export.serving.parameters import BLS_MODELS, UNOPTIMIZED_SERVING_LEVEL
from bionemo_export.tensors import DType, TensorSpec

from .plan import ModelPlan, RepositoryPlan

HOSTED_GRAPHS = "hosted_graphs"
"""N_encoder's config parameter: {stem: {"file": "<stem>.onnx", "outputs": [...]}} (JSON)."""
SHARED_WEIGHTS = "shared_weights"
"""N_encoder's config parameter: {"file", "bytes", "sha256"} of the weights file its graphs share (JSON)."""
GOLDEN_SUFFIX = ".golden.npz"
"""A hosted graph's golden answers: `<stem>.golden.npz` beside `<stem>.onnx` (serving/golden.py)."""
HOSTED_TOKEN_INPUTS = ("input_ids", "attention_mask")
GRAPH_CHECK_PARAMETERS = ("axes", "axis_limits", "token_inputs")
"""The hosted graphs' input checks (serving/graph_model.GraphInputs), the same for every one of them."""


def host_graphs(plan: RepositoryPlan, encoder_name: str, hosted: dict[Path, str], weights: Path) -> list[str]:
    """Fold every Python graph model of `plan` whose model.onnx is a key of `hosted` (a graph file
    written over `weights` -> its stem: layers, contacts, attentions) into the model `encoder_name`,
    and point their callers at it. Returns the folded models' names."""
    encoder = plan.model(encoder_name)
    graphs: dict[str, dict] = {}
    folded = []
    for model in list(plan.models):
        graph_file = model.files.get("model.onnx")
        if model.backend != "python" or not isinstance(graph_file, Path) or graph_file not in hosted:
            continue
        stem = hosted[graph_file]
        _fold(encoder, model, stem)
        graphs[stem] = {"file": f"{stem}.onnx", "outputs": [t.name for t in model.outputs],
                        "graph_optimization_level": model.parameters.get("graph_optimization_level",
                                                                         UNOPTIMIZED_SERVING_LEVEL)}
        plan.models.remove(model)
        folded.append(model.name)
    if not folded:
        return []
    encoder.files[weights.name] = weights
    encoder.parameters[HOSTED_GRAPHS] = json.dumps(graphs)
    digest = file_digest(weights)
    encoder.parameters[SHARED_WEIGHTS] = json.dumps({"file": weights.name, **digest})
    for model in plan.models:  # the callers: N_layers, N_contacts, N_attentions
        if model.parameters.get("graph_model") in folded:
            model.parameters["graph_model"] = encoder_name
        if BLS_MODELS in model.parameters:
            callees = [encoder_name if callee in folded else callee
                       for callee in model.parameters[BLS_MODELS].split(",")]
            model.parameters[BLS_MODELS] = ",".join(dict.fromkeys(callees))
    encoder.description += f"; hosts the {', '.join(graphs)} graphs over one {weights.name}"
    return folded


def _fold(encoder: ModelPlan, graph_model: ModelPlan, stem: str) -> None:
    """`graph_model`'s graph, golden answers, outputs and input checks added to `encoder`."""
    files = graph_model.files
    encoder.files[f"{stem}.onnx"] = files["model.onnx"]
    if "golden.npz" in files:
        encoder.files[f"{stem}{GOLDEN_SUFFIX}"] = files["golden.npz"]
    # The graph model's tensors are unbatched (its first axis the rows); N_encoder batches.
    for tensor in graph_model.outputs:
        encoder.outputs.append(TensorSpec(tensor.name, tensor.dtype, tuple(tensor.dims[1:])))
    for name in GRAPH_CHECK_PARAMETERS:
        encoder.parameters.setdefault(name, graph_model.parameters[name])
    known = {t.name for t in encoder.inputs}
    for name in HOSTED_TOKEN_INPUTS:
        if name not in known:
            encoder.inputs.append(TensorSpec(name, DType.INT64, (-1,), optional=True, ragged=True))
    # A request names either the encoder's inputs or a hosted graph's: none is required by both.
    encoder.inputs = [TensorSpec(t.name, t.dtype, t.dims, optional=True, ragged=t.ragged) for t in encoder.inputs]
