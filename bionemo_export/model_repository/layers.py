"""The models of the layers task (every family): N_layers.

For `--name N`, on top of the encoder models (encoder.py):

    N_layer_graph  graph   input_ids, attention_mask INT64 [rows, T] -> hiddens_0 .. hiddens_N FP32
                           [rows, T, H] (the exported layers graph: every layer's states as separate
                           outputs; run by the backend, backends.py, which copies out only the outputs
                           a call asks for; not batched by Triton, its caller batches)
    N_layers       python  sequences BYTES [1]; optional layers INT32 [-1], include BYTES [-1] ->
                           embeddings, embeddings_bos, embeddings_max FP32 [-1, H], hiddens FP32
                           [-1, -1, H], mask BOOL [-1], each only when included (tokenizes, checks the
                           choices, sends the rows to N_layer_graph through BLS asking for the requested
                           layers only, pools: serving/layers.py)

With `--backend python` the build folds the graph model into N_encoder, which serves the graph
beside its own over one weights file, and the public model calls N_encoder (hosted_graphs.py).

The encoder graph (and so N_embeddings, N_hiddens) is not changed. N_layers' settings are its
config `parameters`: num_layers (N), hidden_size, has_bos, token_budget, max_rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bionemo_export.serving.layers import DEFAULT_TOKEN_BUDGET, layer_output_name
from bionemo_export.serving.parameters import BLS_MODELS
from bionemo_export.tasks import TASKS
from bionemo_export.tensors import DType, TensorSpec

from .encoder import (
    describe_layout,
    python_model,
    token_graph_model,
    tokenizer_files,
    tokenizer_sources,
)
from .options import ServingOptions
from .plan import ModelPlan

LAYER_TASKS = ("layers",)
"""The tasks whose models this module plans."""


@dataclass(frozen=True)
class LayerGraph:
    """What the planner needs of the exported layers graph."""

    files: dict[str, Path]
    """The graph's version-folder files (model.onnx, golden answers)."""
    num_layers: int
    """N: the graph answers hiddens_0 .. hiddens_N."""
    hidden_size: int
    has_bos: bool
    """Whether the tokenizer's rows start with a BOS/CLS token (not a residue)."""


def layer_graph_model(name: str, family: str, tokenizer, graph: LayerGraph, options: ServingOptions) -> ModelPlan:
    """N_layer_graph: the layers graph, its batch its first axis but batched by its caller."""
    outputs = [TensorSpec(layer_output_name(i), DType.FP32, (-1, -1, graph.hidden_size))
               for i in range(graph.num_layers + 1)]
    return token_graph_model(f"{name}_layer_graph", family, tokenizer, outputs, graph.files,
                             role=options.role("layer_graph"), options=options,
                             what=f"every layer's hidden states ({graph.num_layers} blocks and the embedding)")

def layers_model(name: str, family: str, tokenizer, graph: LayerGraph, options: ServingOptions) -> ModelPlan:
    """N_layers: the Python model that tokenizes, calls N_layer_graph through BLS and pools."""
    task = TASKS["layers"]
    role = options.role("layers")
    graph_name = f"{name}_layer_graph"
    tokenizer_parameters, files = tokenizer_files(tokenizer)
    served, code = python_model("models.LayersModel", "layers", model_name=task.model(name), family=family,
                                tokenizer_sources=tokenizer_sources(tokenizer), layout=describe_layout(tokenizer),
                                graph_model=graph_name, num_layers=graph.num_layers)
    plan = ModelPlan.public_python(
        task, name, role, options.max_batch_size,
        parameters={BLS_MODELS: graph_name, "graph_model": graph_name, "num_layers": str(graph.num_layers),
                    "hidden_size": str(graph.hidden_size), "has_bos": "true" if graph.has_bos else "false",
                    "token_budget": str(options.token_budget or DEFAULT_TOKEN_BUDGET),
                    "max_rows": str(options.max_batch_size), **tokenizer_parameters, **served},
        files={**code, **files},
        description="public: layers (Python: tokenizer, BLS to the layers graph, pooling)",
    )
    return plan


def plan_layer_models(name: str, *, family: str, tokenizer, tasks: tuple[str, ...], options: ServingOptions,
                      graph: LayerGraph) -> list[ModelPlan]:
    """The models `tasks` (among LAYER_TASKS) need, to add to the encoder repository's plan."""
    if not any(task in LAYER_TASKS for task in tasks):
        return []
    return [layer_graph_model(name, family, tokenizer, graph, options),
            layers_model(name, family, tokenizer, graph, options)]
