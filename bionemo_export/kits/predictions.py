"""predictions: the fine-tuned head's graph after the encoder's, N_labels naming its answers,
compared with PyTorch's encoder and head."""

from __future__ import annotations

import dataclasses

import numpy as np

from bionemo_export.errors import InvalidInputError
from bionemo_export.exporters.lm_head import lm_head_check_batches
from bionemo_export.model_repository.classifier import CLASSIFIER_TASKS, ClassifierGraph, plan_classifier_models
from bionemo_export.model_repository.plan import ModelPlan
from bionemo_export.serving.labels import label_names
from bionemo_export.tasks import Graph

from .base import Answers, GraphExport, PlanContext, Requests, TaskKit, register_kit
from .comparison import TaskCheck, VerifyContext, compare_outputs, task_check
from .dev import DevAnswers


@register_kit
class PredictionsKit(TaskKit):
    """N_predictions: a fine-tuned sequence or token head's logits and labels."""

    tasks = CLASSIFIER_TASKS
    # A sequence head reads position 0 only: the check batches' padding mask applies to token
    # heads' [B, L, C] logits.
    graphs = {Graph.CLASSIFIER: GraphExport(lambda loaded, batches: (loaded.classifier, loaded.lm_head_inputs,
                                                                     loaded.classifier_outputs,
                                                                     lm_head_check_batches(loaded)))}

    def plan(self, context: PlanContext) -> list[ModelPlan]:
        loaded, head = context.loaded, context.loaded.classifier
        assert head is not None  # Requirement.CLASSIFIER: servable_tasks left the task out otherwise
        return plan_classifier_models(
            context.name, hidden_size=loaded.hidden_size, tasks=context.tasks, options=context.serving,
            head=ClassifierGraph(context.graph_files(Graph.CLASSIFIER)["model.onnx"], head.labels, head.problem_type,
                                 head.per_token),
            max_length=loaded.tokenizer.max_length, family=loaded.family.name)

    def check(self, context: VerifyContext, tasks: list[str]) -> list[TaskCheck]:
        return verify_predictions(context.client, context.loaded, tasks, context.batches, context.head_limits())

    def answer(self, dev: DevAnswers, task: str, requests: Requests) -> Answers:
        return _predictions(dev, requests)


def _predictions(dev: DevAnswers, requests: Requests) -> Answers:
    """The fine-tuned head's logits and labels (serving/labels.py names them, as N_labels does)."""
    head = dev.loaded.classifier
    if head is None:  # no predictions model is bound then
        raise InvalidInputError(f"{dev.loaded.checkpoint} has no fine-tuned head, so it serves no predictions")
    answers = []
    for hiddens, _, mask in dev.encode(requests):
        logits = dev.run_head(head, hiddens)
        answer = {"logits": logits, "label": label_names(logits, head.labels, head.problem_type)}
        if head.per_token:
            answer["mask"] = mask
        answers.append(answer)
    return answers


def verify_predictions(client, loaded, tasks: list[str], batches: list[list[str]], limits: tuple[float, float]
                       ) -> list[TaskCheck]:
    """predictions: served logits against PyTorch's encoder + fine-tuned head on each batch (token
    heads on real tokens only), and the served labels equal to the argmax's names (single-label)."""
    import torch

    if "predictions" not in tasks or loaded.classifier is None:
        return []
    head, checks = loaded.classifier, []
    for batch in batches:
        served = client.predict(batch)
        encoded = loaded.tokenizer.encode(batch)
        with torch.no_grad():
            hiddens, _ = loaded.encoder(torch.from_numpy(encoded.input_ids), torch.from_numpy(encoded.attention_mask),
                                        torch.from_numpy(encoded.residue_mask))
            expected = head(hiddens).numpy()
        logits = served["logits"]
        mask_exact = None
        if head.per_token:
            attention = encoded.attention_mask.astype(bool)
            mask_exact = bool(served["mask"].shape == encoded.residue_mask.shape
                              and np.array_equal(served["mask"], encoded.residue_mask))
            found = compare_outputs(logits[attention], expected[attention]) if logits.shape == expected.shape \
                else compare_outputs(logits, expected)
        else:
            found = compare_outputs(logits, expected)
        if found.problem is None and head.problem_type == "single_label_classification":
            names = np.asarray(head.labels, dtype=object)[expected.argmax(-1)]
            if head.per_token:
                labels_equal = all(list(served["label"][r][:int(attention[r].sum())]) == list(names[r][attention[r]])
                                   for r in range(len(batch)))
            else:
                labels_equal = list(served["label"]) == list(names)
            if not labels_equal:
                found = dataclasses.replace(found, problem="served labels differ from the reference argmax's names")
        checks.append(task_check(client.model("predictions"), batch, found, mask_exact, limits,
                                  f"{head.problem_type}, {len(head.labels)} labels"))
    return checks
