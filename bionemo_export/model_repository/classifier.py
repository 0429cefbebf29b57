"""The models of a fine-tuned head (a *ForSequenceClassification or *ForTokenClassification
checkpoint): N_predictions.

For `--name N`, on top of the encoder models (encoder.py):

    N_classifier   graph     hiddens FP32 [-1, H] -> logits FP32 [C] (sequence heads: the graph
                             reads position 0) or [-1, C] (token heads)
                             (the exported head, classifier.onnx; in the Python backend each
                             request is one ONNX Runtime run, serving/graph_model.py: a sequence
                             head reads position 0, so positions cannot be joined across requests)
    N_labels       python    logits -> label BYTES [1] (token heads [-1]) (serving/labels.py)
    N_predictions  ensemble  sequences -> logits, label (token heads: and mask)
                             (the encoder's steps, then N_classifier, then N_labels)

The label names (id2label, `LABEL_i` where the config names none) and the problem type reach
N_labels, and the public ensemble for clients, as config `parameters`: `labels` (a JSON list),
`problem_type`, `per_token`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bionemo_export.tensors import DType, TensorSpec

from .backends import GraphModel, ShapeRange
from .encoder import _io_lines, ensemble_model, graph_input_parameters, python_model
from .options import ServingOptions
from .plan import EnsembleStep, ModelPlan

CLASSIFIER_TASKS = ("predictions",)
"""The tasks whose models this module plans."""


@dataclass(frozen=True)
class ClassifierGraph:
    """What the planner needs of a checkpoint's fine-tuned head."""

    onnx_file: Path
    labels: tuple[str, ...]
    problem_type: str
    per_token: bool

    def parameters(self) -> dict[str, str]:
        return {"labels": json.dumps(list(self.labels)), "problem_type": self.problem_type,
                "per_token": "true" if self.per_token else "false"}

    @property
    def logits_dims(self) -> tuple[int, ...]:
        return (-1, len(self.labels)) if self.per_token else (len(self.labels),)

    @property
    def label_dims(self) -> tuple[int, ...]:
        return (-1,) if self.per_token else (1,)


def classifier_model(name: str, hidden_size: int, head: ClassifierGraph, options: ServingOptions,
                     max_length: int, family: str = "") -> ModelPlan:
    """N_classifier: the head graph, batched like the encoder."""
    role = options.role("classifier")
    backend = options.serving_backend
    inputs = [TensorSpec("hiddens", DType.FP32, (-1, hidden_size), ragged=backend.runs_python)]
    outputs = [TensorSpec("logits", DType.FP32, head.logits_dims)]
    plan = ModelPlan(name=f"{name}_classifier", inputs=inputs, outputs=outputs,
                     max_batch_size=options.max_batch_size, dynamic_batching=role.batching)
    shapes = ShapeRange(axes={"hiddens": ("batch", "length", hidden_size)},
                        sizes={"batch": (1, options.max_batch_size), "length": (1, max_length)},
                        split_axis="length", bucket=options.length_bucket or 16, opt={"batch": options.max_batch_size})

    backend.plan_graph(GraphModel(plan, role, "fine-tuned head", {"model.onnx": head.onnx_file}, shapes,
                                  lambda: python_model("models.GraphModelRunner", "onnx", model_name=plan.name,
                                                       family=family, what="fine-tuned head",
                                                       io_lines=_io_lines(inputs, outputs, batched=True)),
                                  python_parameters=graph_input_parameters(shapes.axes, {"length": max_length}, {})))
    return plan


def labels_model(name: str, head: ClassifierGraph, options: ServingOptions) -> ModelPlan:
    """N_labels: logits -> label names (Python, serving/labels.py)."""
    role = options.role("labels")
    served, code = python_model("models.LabelsModel", "labels", model_name=f"{name}_labels",
                                input_dims=f"[batch, {', '.join(map(str, head.logits_dims))}]",
                                output_dims=f"[batch, {', '.join(map(str, head.label_dims))}]")
    inputs = [TensorSpec("logits", DType.FP32, head.logits_dims, ragged=head.per_token)]
    outputs = [TensorSpec("label", DType.BYTES, head.label_dims)]
    return ModelPlan(
        name=f"{name}_labels", inputs=inputs, outputs=outputs, max_batch_size=options.max_batch_size,
        backend="python", instance_count=role.instances, dynamic_batching=role.batching,
        parameters={**head.parameters(), **served}, files=code,
        description="fine-tuned head's label names (Python)",
    )


def predictions_ensemble(name: str, head: ClassifierGraph, options: ServingOptions) -> ModelPlan:
    """N_predictions: the encoder's steps, then N_classifier, then N_labels."""
    outputs = [TensorSpec("logits", DType.FP32, head.logits_dims)]
    encoder_outputs = {"hiddens": "hiddens"}
    if head.per_token:
        outputs.append(TensorSpec("mask", DType.BOOL, (-1,)))
        encoder_outputs["mask"] = "mask"
    outputs.append(TensorSpec("label", DType.BYTES, head.label_dims))
    plan = ensemble_model(name, "predictions", outputs, options, encoder_outputs, after=[
        EnsembleStep(f"{name}_classifier", {"hiddens": "hiddens"}, {"logits": "logits"}),
        EnsembleStep(f"{name}_labels", {"logits": "logits"}, {"label": "label"})])
    plan.parameters = head.parameters()
    return plan


def plan_classifier_models(name: str, *, hidden_size: int, head: ClassifierGraph, tasks: tuple[str, ...],
                           options: ServingOptions, max_length: int, family: str = "") -> list[ModelPlan]:
    """The models `tasks` (among CLASSIFIER_TASKS) need, to add to the encoder repository's plan."""
    if not any(task in CLASSIFIER_TASKS for task in tasks):
        return []
    return [classifier_model(name, hidden_size, head, options, max_length, family), labels_model(name, head, options),
            predictions_ensemble(name, head, options)]
