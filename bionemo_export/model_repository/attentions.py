"""The models of the attentions task (transformers encoders): N_attentions.

For `--name N`, on top of the encoder models (encoder.py):

    N_attention_graph  graph   input_ids, attention_mask INT64 [rows, T] -> attentions_1 ..
                               attentions_N FP32 [rows, heads, T, T] (the exported attentions graph:
                               every block's probabilities as separate outputs; run by the backend,
                               backends.py, which copies out only the outputs a call asks for; not
                               batched by Triton, its caller batches)
    N_attentions       python  sequences BYTES [1]; optional layers, heads INT32 [-1] -> attentions
                               FP32 [-1, -1, -1, -1], mask BOOL [-1] (tokenizes, checks the choices and
                               the answer's size, sends the rows to N_attention_graph through BLS asking
                               for the requested blocks only, picks the heads: serving/attentions.py)

With `--backend python` the build folds the graph model into N_encoder, which serves the graph
beside its own over one weights file, and the public model calls N_encoder (hosted_graphs.py).

The encoder graph (and so N_embeddings, N_hiddens) is not changed. N_attentions' settings are its
config `parameters`: num_layers, num_heads, max_attention_values (`--max-attention-values`),
pair_budget, max_rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bionemo_export.serving.attentions import attention_output_name
from bionemo_export.serving.parameters import BLS_MODELS
from bionemo_export.serving.row_calls import DEFAULT_PAIR_BUDGET
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

ATTENTION_TASKS = ("attentions",)
"""The tasks whose models this module plans."""


@dataclass(frozen=True)
class AttentionGraph:
    """What the planner needs of the exported attentions graph."""

    files: dict[str, Path]
    """The graph's version-folder files (model.onnx, golden answers)."""
    num_layers: int
    """N: the graph answers attentions_1 .. attentions_N."""
    num_heads: int


def attention_graph_model(name: str, family: str, tokenizer, graph: AttentionGraph,
                          options: ServingOptions) -> ModelPlan:
    """N_attention_graph: the attentions graph, its batch its first axis but batched by its caller."""
    outputs = [TensorSpec(attention_output_name(i), DType.FP32, (-1, graph.num_heads, -1, -1))
               for i in range(1, graph.num_layers + 1)]
    return token_graph_model(f"{name}_attention_graph", family, tokenizer, outputs, graph.files,
                             role=options.role("attention_graph"), options=options,
                             what=f"attention probabilities ({graph.num_layers} blocks x {graph.num_heads} heads)")

def attentions_model(name: str, family: str, tokenizer, graph: AttentionGraph, options: ServingOptions) -> ModelPlan:
    """N_attentions: the Python model that tokenizes, calls N_attention_graph through BLS and picks
    the heads."""
    task = TASKS["attentions"]
    graph_name = f"{name}_attention_graph"
    tokenizer_parameters, files = tokenizer_files(tokenizer)
    served, code = python_model("models.AttentionsModel", "attentions", model_name=task.model(name),
                                family=family, tokenizer_sources=tokenizer_sources(tokenizer),
                                layout=describe_layout(tokenizer), graph_model=graph_name)
    return ModelPlan.public_python(
        task, name, options.role("attentions"), options.max_batch_size,
        parameters={BLS_MODELS: graph_name, "graph_model": graph_name, "num_layers": str(graph.num_layers),
                    "num_heads": str(graph.num_heads), "max_attention_values": str(options.max_attention_values),
                    "pair_budget": str(DEFAULT_PAIR_BUDGET), "max_rows": str(options.max_batch_size),
                    **tokenizer_parameters, **served},
        files={**code, **files},
        description="public: attentions (Python: tokenizer, BLS to the attentions graph, head choice)",
    )


def plan_attention_models(name: str, *, family: str, tokenizer, tasks: tuple[str, ...], options: ServingOptions,
                          graph: AttentionGraph) -> list[ModelPlan]:
    """The models `tasks` (among ATTENTION_TASKS) need, to add to the encoder repository's plan."""
    if not any(task in ATTENTION_TASKS for task in tasks):
        return []
    return [attention_graph_model(name, family, tokenizer, graph, options),
            attentions_model(name, family, tokenizer, graph, options)]
