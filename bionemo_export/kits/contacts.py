"""contacts: the encoder again with every layer's attention into ESM's contact head (its own
graph), N_contacts answering one map per sequence, compared with PyTorch's contact head."""

from __future__ import annotations

import numpy as np
import torch

from bionemo_export.errors import InvalidInputError
from bionemo_export.model_repository.contacts import CONTACT_TASKS, ContactGraph, plan_contact_models
from bionemo_export.model_repository.plan import ModelPlan
from bionemo_export.models.base import CONTACT_INPUTS, CONTACT_OUTPUTS
from bionemo_export.serving.contacts import ContactMaps
from bionemo_export.serving.responses import Responder
from bionemo_export.serving.row_calls import DEFAULT_PAIR_BUDGET
from bionemo_export.tasks import Graph

from .base import Answers, GraphExport, PlanContext, Requests, TaskKit, register_kit
from .comparison import Comparison, TaskCheck, VerifyContext, compare_outputs, task_check
from .dev import MAX_BATCH_SIZE, DevAnswers, answer_rows


@register_kit
class ContactsKit(TaskKit):
    """N_contacts: residue-residue contact probabilities."""

    tasks = CONTACT_TASKS
    # The encoder again with every layer's attention probabilities (eager attention): a graph of its
    # own, so the encoder's graph keeps its fused attention. Its output is [B, T-2, T-2] residue
    # pairs, compared whole (padding rows hold the head's answer to zeroed features, in both).
    graphs = {Graph.CONTACTS: GraphExport(lambda loaded, batches: (loaded.contacts, CONTACT_INPUTS, CONTACT_OUTPUTS,
                                                                   batches), mask_input="")}

    def plan(self, context: PlanContext) -> list[ModelPlan]:
        loaded = context.loaded
        graph = ContactGraph(context.graph_files(Graph.CONTACTS), layers=loaded.description.get("layers", 0),
                             heads=loaded.description.get("heads", 0))
        return plan_contact_models(context.name, family=loaded.family.name, tokenizer=loaded.tokenizer,
                                   tasks=context.tasks, options=context.serving, graph=graph)

    def check(self, context: VerifyContext, tasks: list[str]) -> list[TaskCheck]:
        return verify_contacts(context.client, context.loaded, tasks, context.batches, context.family_limits())

    def answer(self, dev: DevAnswers, task: str, requests: Requests) -> Answers:
        return _contacts(dev, requests)


def _contacts(dev: DevAnswers, requests: Requests) -> Answers:
    """Contact maps from the PyTorch contact head, tokenized, checked and batched by the
    repository's own module (serving/contacts.py: the same limit and messages)."""
    head = dev.loaded.contacts
    if head is None:  # no contacts model is bound then
        raise InvalidInputError(f"{dev.loaded.checkpoint} has no contact head, so it serves no contacts")

    def run(input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return head(torch.from_numpy(input_ids), torch.from_numpy(attention_mask)).numpy()

    tokenizer = dev.loaded.tokenizer
    limit = getattr(tokenizer, "max_residues", tokenizer.max_length - 2)
    return answer_rows(ContactMaps(tokenizer, run, max_residues=limit, pair_budget=DEFAULT_PAIR_BUDGET,
                                    max_rows=MAX_BATCH_SIZE, responder=Responder("contacts")), requests)


def verify_contacts(client, loaded, tasks: list[str], batches: list[list[str]], limits: tuple[float, float]
                    ) -> list[TaskCheck]:
    """contacts: each sequence's served [L, L] map against the PyTorch contact head on that
    sequence alone (its map does not depend on what it is batched with)."""
    import torch

    if "contacts" not in tasks or loaded.contacts is None:
        return []
    checks = []
    for batch in batches:
        served = client.predict_contacts(batch)
        expected = []
        for sequence in batch:
            encoded = loaded.tokenizer.encode([sequence])
            with torch.no_grad():
                expected.append(loaded.contacts(torch.from_numpy(encoded.input_ids),
                                                torch.from_numpy(encoded.attention_mask))[0].numpy())
        if [m.shape for m in served] != [m.shape for m in expected]:
            found = Comparison(float("inf"), float("-inf"), f"served maps of shapes {[m.shape for m in served]}, "
                               f"expected {[m.shape for m in expected]}")
        else:  # the rows of each map compared as vectors
            each = [compare_outputs(got, want) for got, want in zip(served, expected)]
            found = Comparison(max(c.max_abs_error for c in each), min(c.min_cosine for c in each),
                               next((c.problem for c in each if c.problem), None))
        checks.append(task_check(client.model("contacts"), batch, found, None, limits,
                                  "each [L, L] map against PyTorch's contact head"))
    return checks
