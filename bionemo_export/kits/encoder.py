"""embeddings and hiddens: the encoder's graph, the repository's base, compared with PyTorch's encoder."""

from __future__ import annotations

import dataclasses

import numpy as np

from bionemo_export.client import EncoderClient
from bionemo_export.model_repository.encoder import ENCODER_TASKS, plan_encoder_repository
from bionemo_export.model_repository.plan import ModelPlan
from bionemo_export.models import LoadedModel
from bionemo_export.tasks import Graph

from .base import Answers, GraphExport, PlanContext, Requests, TaskKit, register_kit
from .comparison import TaskCheck, VerifyContext, compare_outputs, reference_encoding, task_check
from .dev import DevAnswers


@register_kit
class EncoderKit(TaskKit):
    """The encoder's public models: the repository's base for every encoder-only family."""

    tasks = ENCODER_TASKS
    graphs = {Graph.ENCODER: GraphExport(lambda loaded, batches: (loaded.encoder, loaded.inputs, loaded.outputs,
                                                                  batches), encoder=True)}
    plans_base = True

    def is_base(self, loaded: LoadedModel) -> bool:
        return loaded.seq2seq is None  # an encoder-decoder family's repository is the decoding kit's

    def plan(self, context: PlanContext) -> list[ModelPlan]:
        loaded, encoder = context.loaded, context.graphs[Graph.ENCODER.value]
        return plan_encoder_repository(
            context.name, family=loaded.family.name, hidden_size=loaded.hidden_size, tokenizer=loaded.tokenizer,
            onnx_files=encoder.files, tasks=context.tasks, options=context.serving,
            graph_optimization_level=encoder.record.optimization.serving_graph_optimization_level).models

    def check(self, context: VerifyContext, tasks: list[str]) -> list[TaskCheck]:
        family = context.loaded.family
        return verify_served(context.client, context.loaded, tasks, context.batches, family.atol, family.min_cosine,
                             tolerances=context.tolerances, notes=context.notes)

    def answer(self, dev: DevAnswers, task: str, requests: Requests) -> Answers:
        encoded = dev.encode(requests)
        if task == "embeddings":
            return [{"embeddings": embeddings} for _, embeddings, _ in encoded]
        return [{"hiddens": hiddens, "mask": mask} for hiddens, _, mask in encoded]


def verify_served(client: EncoderClient, loaded, tasks: list[str], batches: list[list[str]],
                  atol: float, min_cosine: float, tolerances: dict | None = None,
                  notes: dict[str, str] | None = None) -> list[TaskCheck]:
    """Compare the served public models with PyTorch on each batch. `tolerances` (task ->
    exporters.Tolerance) overrides `atol`/`min_cosine` per task; `notes` (task -> text) is
    attached to that task's checks."""
    tolerances, notes = tolerances or {}, notes or {}
    limits = {task: (tolerances[task].atol, tolerances[task].min_cosine) if task in tolerances else (atol, min_cosine)
              for task in ("embeddings", "hiddens")}
    checks = []
    for batch in batches:
        ref_hiddens, ref_embeddings, attention, residues = reference_encoding(loaded, batch)
        if "embeddings" in tasks:
            found = compare_outputs(client.seqs_to_embedding(batch), ref_embeddings)
            checks.append(task_check(f"{client.name}_embeddings", batch, found, None, limits["embeddings"],
                                      notes.get("embeddings", "")))
        if "hiddens" in tasks:
            hiddens, mask = client.seqs_to_hidden(batch)
            mask_exact = bool(mask.shape == residues.shape and np.array_equal(mask, residues))
            if hiddens.shape == ref_hiddens.shape:
                # Padding positions are don't-care; every real token (BOS/EOS included) must match.
                found = compare_outputs(hiddens[attention], ref_hiddens[attention])
            else:
                found = compare_outputs(hiddens, ref_hiddens)
            if found.problem is None and not mask_exact:
                found = dataclasses.replace(found, problem="served mask differs from the reference's")
            checks.append(task_check(f"{client.name}_hiddens", batch, found, mask_exact, limits["hiddens"],
                                      notes.get("hiddens", "")))
    return checks
