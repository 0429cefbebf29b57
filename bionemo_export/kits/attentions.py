"""attentions: the encoder again with eager attention answering every block's probabilities (its
own graph), N_attentions answering the blocks and heads a request names, compared with
transformers' output_attentions."""

from __future__ import annotations

import numpy as np
import torch

from bionemo_export.model_repository.attentions import ATTENTION_TASKS, AttentionGraph, plan_attention_models
from bionemo_export.model_repository.plan import ModelPlan
from bionemo_export.models.base import LAYER_INPUTS
from bionemo_export.serving.attentions import AttentionWeights
from bionemo_export.serving.responses import Responder
from bionemo_export.serving.row_calls import DEFAULT_PAIR_BUDGET
from bionemo_export.tasks import DEFAULT_MAX_ATTENTION_VALUES, Graph

from .base import Answers, GraphExport, PlanContext, Requests, TaskKit, register_kit
from .comparison import Comparison, TaskCheck, VerifyContext, compare_outputs, task_check
from .dev import MAX_BATCH_SIZE, DevAnswers, answer_rows


@register_kit
class AttentionsKit(TaskKit):
    """N_attentions: chosen blocks' and heads' attention probabilities."""

    tasks = ATTENTION_TASKS
    # The encoder again with eager attention, every block's probabilities as separate outputs
    # (attentions_1 .. attentions_N). [B, heads, T, T] compared whole: padded query rows hold the
    # softmax over the real keys, in both.
    graphs = {Graph.ATTENTIONS: GraphExport(lambda loaded, batches: (loaded.attention_maps, LAYER_INPUTS,
                                                                     loaded.attention_outputs, batches),
                                            mask_input="")}

    def plan(self, context: PlanContext) -> list[ModelPlan]:
        loaded = context.loaded
        graph = AttentionGraph(context.graph_files(Graph.ATTENTIONS), num_layers=loaded.num_layers,
                               num_heads=loaded.num_heads)
        return plan_attention_models(context.name, family=loaded.family.name, tokenizer=loaded.tokenizer,
                                     tasks=context.tasks, options=context.serving, graph=graph)

    def check(self, context: VerifyContext, tasks: list[str]) -> list[TaskCheck]:
        return verify_attentions(context.client, context.loaded, tasks, context.batches, context.family_limits())

    def answer(self, dev: DevAnswers, task: str, requests: Requests) -> Answers:
        return _attentions(dev, requests)


def _attentions(dev: DevAnswers, requests: Requests) -> Answers:
    """Chosen blocks' and heads' attention probabilities from the PyTorch encoder's eager twin
    (transformers' output_attentions), the choices and the size limit checked, batched and
    assembled by the repository's own module (serving/attentions.py: the same messages)."""
    maps = dev.attention_maps

    def run(input_ids: np.ndarray, attention_mask: np.ndarray, layers) -> list[np.ndarray]:
        with torch.inference_mode():
            every = maps(torch.from_numpy(input_ids), torch.from_numpy(attention_mask))
        return [every[layer - 1].numpy() for layer in layers]

    return answer_rows(AttentionWeights(dev.loaded.tokenizer, run, num_layers=dev.loaded.num_layers,
                                         num_heads=dev.loaded.num_heads, max_values=DEFAULT_MAX_ATTENTION_VALUES,
                                         pair_budget=DEFAULT_PAIR_BUDGET, max_rows=MAX_BATCH_SIZE,
                                         responder=Responder("attentions")), requests)


def verify_attentions(client, loaded, tasks: list[str], batches: list[list[str]], limits: tuple[float, float]
                      ) -> list[TaskCheck]:
    """attentions: the first, a middle and the last block, every head, of each batch against the
    PyTorch encoder's eager attention (output_attentions), each sequence's own [T, T] block of
    every head compared as rows (its padding answers 0 when served)."""
    import torch

    if "attentions" not in tasks or not loaded.returns_attentions:
        return []
    count = loaded.num_layers
    layers = list(dict.fromkeys([1, max(count // 2, 1), count]))
    maps = loaded.attention_maps
    checks = []
    for batch in batches:
        encoded = loaded.tokenizer.encode(batch)
        with torch.no_grad():
            every = maps(torch.from_numpy(encoded.input_ids), torch.from_numpy(encoded.attention_mask))
        want = np.stack([every[layer - 1].numpy() for layer in layers], axis=1)  # [B, K, heads, T, T]
        served = client.attention_maps(batch, layers)
        got, mask = served["attentions"], served["mask"]
        residues = encoded.residue_mask.astype(bool)
        mask_exact = bool(mask.shape == residues.shape and np.array_equal(mask, residues))
        if got.shape != want.shape:
            found = Comparison(float("inf"), float("-inf"), f"served attentions of shape {list(got.shape)}, "
                               f"expected {list(want.shape)}")
        else:
            each = []
            for row, tokens in enumerate(encoded.attention_mask.sum(axis=1)):
                n = int(tokens)
                each.append(compare_outputs(got[row, :, :, :n, :n].reshape(-1, n),
                                            want[row, :, :, :n, :n].reshape(-1, n)))
                if np.any(got[row, :, :, n:]) or np.any(got[row, :, :, :, n:]):
                    each.append(Comparison(float("inf"), float("-inf"), f"row {row}: nonzero past its {n} tokens"))
            found = Comparison(max(c.max_abs_error for c in each), min(c.min_cosine for c in each),
                               next((c.problem for c in each if c.problem), None))
        checks.append(task_check(client.model("attentions"), batch, found, mask_exact, limits,
                                  f"blocks {layers}, every head, against output_attentions"))
    return checks
