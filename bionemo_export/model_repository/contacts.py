"""The models of the contact-map task (a checkpoint with ESM's contact head): N_contacts.

For `--name N`, on top of the encoder models (encoder.py):

    N_contact_graph  graph   input_ids, attention_mask INT64 [rows, T] -> contacts FP32 [rows, T-2, T-2]
                             (the exported contacts graph: the encoder again, eager attention, every
                             layer's attention probabilities into the contact head; run by the backend,
                             backends.py; not batched by Triton, its caller batches)
    N_contacts       python  sequences BYTES [1] -> contacts FP32 [-1, -1], mask BOOL [-1]
                             (tokenizes, checks the length limit, sends the rows to N_contact_graph
                             through BLS in calls bounded by a token-pair budget, cuts each map to
                             [L, L]: serving/contacts.py)

With `--backend python` the build folds the graph model into N_encoder, which serves the graph
beside its own over one weights file, and the public model calls N_encoder (hosted_graphs.py).

The encoder graph (and so N_embeddings, N_hiddens) is not changed: only N_contact_graph computes the
attention probabilities. The limits are N_contacts' config `parameters`: max_residues (default: the
tokenizer's limit), pair_budget, max_rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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

CONTACT_TASKS = ("contacts",)
"""The tasks whose models this module plans."""


@dataclass(frozen=True)
class ContactGraph:
    """What the planner needs of the exported contacts graph."""

    files: dict[str, Path]
    """The graph's version-folder files (model.onnx, golden answers)."""
    layers: int = 0
    heads: int = 0


def contact_graph_model(name: str, family: str, tokenizer, graph: ContactGraph, options: ServingOptions) -> ModelPlan:
    """N_contact_graph: the contacts graph, its batch its first axis but batched by its caller."""
    what = f"contact map ({graph.layers} layers x {graph.heads} heads of attention)" if graph.layers else "contact map"
    outputs = [TensorSpec("contacts", DType.FP32, (-1, -1, -1))]
    return token_graph_model(f"{name}_contact_graph", family, tokenizer, outputs, graph.files,
                             role=options.role("contact_graph"), options=options, what=what, min_length=3)

def contacts_model(name: str, family: str, tokenizer, options: ServingOptions, max_residues: int | None = None,
                   pair_budget: int = DEFAULT_PAIR_BUDGET) -> ModelPlan:
    """N_contacts: the Python model that tokenizes and calls N_contact_graph through BLS."""
    task = TASKS["contacts"]
    role = options.role("contacts")
    graph = f"{name}_contact_graph"
    limit = tokenizer.max_residues
    tokenizer_parameters, files = tokenizer_files(tokenizer)
    served, code = python_model("models.ContactsModel", "contacts", model_name=task.model(name), family=family,
                                tokenizer_sources=tokenizer_sources(tokenizer),
                                layout=describe_layout(tokenizer), graph_model=graph, model_max_residues=limit)
    return ModelPlan.public_python(
        task, name, role, options.max_batch_size,
        parameters={BLS_MODELS: graph, "graph_model": graph, "max_residues": str(min(max_residues or limit, limit)),
                    "pair_budget": str(pair_budget), "max_rows": str(options.max_batch_size), **tokenizer_parameters,
                    **served},
        files={**code, **files},
        description="public: contacts (Python: tokenizer, BLS to the contact graph)",
    )


def plan_contact_models(name: str, *, family: str, tokenizer, tasks: tuple[str, ...], options: ServingOptions,
                        graph: ContactGraph) -> list[ModelPlan]:
    """The models `tasks` (among CONTACT_TASKS) need, to add to the encoder repository's plan."""
    if not any(task in CONTACT_TASKS for task in tasks):
        return []
    return [contact_graph_model(name, family, tokenizer, graph, options),
            contacts_model(name, family, tokenizer, options)]
