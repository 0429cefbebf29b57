"""layers: the encoder again answering every layer's states (its own graph, optimized as the
encoder's), N_layers pooling the layers a request names, compared with transformers'
output_hidden_states."""

from __future__ import annotations

import numpy as np
import torch

from bionemo_export.model_repository.layers import LAYER_TASKS, LayerGraph, plan_layer_models
from bionemo_export.model_repository.plan import ModelPlan
from bionemo_export.models.base import LAYER_INPUTS
from bionemo_export.serving.layers import DEFAULT_TOKEN_BUDGET, LayerEmbeddings, has_bos_token
from bionemo_export.serving.responses import Responder
from bionemo_export.tasks import Graph

from .base import Answers, GraphExport, PlanContext, Requests, TaskKit, register_kit
from .comparison import Comparison, TaskCheck, VerifyContext, compare_outputs, task_check
from .dev import MAX_BATCH_SIZE, DevAnswers, answer_rows


@register_kit
class LayersKit(TaskKit):
    """N_layers: any layer's states and poolings, chosen per request."""

    tasks = LAYER_TASKS
    # The encoder again with every layer's states as separate outputs (hiddens_0 .. hiddens_N), so
    # that a caller fetches only the layers it names; the encoder's graph is not changed. Compared
    # on the real tokens (attention_mask), like the encoder's hiddens.
    graphs = {Graph.LAYERS: GraphExport(lambda loaded, batches: (loaded.layer_states, LAYER_INPUTS,
                                                                 loaded.layer_outputs, batches), optimized=True)}

    def plan(self, context: PlanContext) -> list[ModelPlan]:
        loaded = context.loaded
        graph = LayerGraph(context.graph_files(Graph.LAYERS), num_layers=loaded.num_layers,
                           hidden_size=loaded.hidden_size,
                           has_bos=has_bos_token(loaded.tokenizer, loaded.family.sample_sequences()[0]))
        return plan_layer_models(context.name, family=loaded.family.name, tokenizer=loaded.tokenizer,
                                 tasks=context.tasks, options=context.serving, graph=graph)

    def check(self, context: VerifyContext, tasks: list[str]) -> list[TaskCheck]:
        return verify_layers(context.client, context.loaded, tasks, context.batches, context.family_limits())

    def answer(self, dev: DevAnswers, task: str, requests: Requests) -> Answers:
        return _layers(dev, requests)


def _layers(dev: DevAnswers, requests: Requests) -> Answers:
    """Any layers' states and poolings from the PyTorch encoder (every layer's states, as
    transformers' output_hidden_states), the choices checked, batched and pooled by the
    repository's own module (serving/layers.py: the same messages)."""
    states = dev.loaded.layer_states

    def run(input_ids: np.ndarray, attention_mask: np.ndarray, layers) -> list[np.ndarray]:
        with torch.inference_mode():
            every = states(torch.from_numpy(input_ids), torch.from_numpy(attention_mask))
        return [every[layer].numpy() for layer in layers]

    tokenizer = dev.loaded.tokenizer
    has_bos = has_bos_token(tokenizer, dev.loaded.family.sample_sequences()[0])
    return answer_rows(LayerEmbeddings(tokenizer, run, num_layers=dev.loaded.num_layers, has_bos=has_bos,
                                        token_budget=DEFAULT_TOKEN_BUDGET, max_rows=MAX_BATCH_SIZE,
                                        responder=Responder("layers")), requests)


def reference_layer_states(loaded, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """Every layer's states [layers + 1, B, T, H], computed apart from the layers graph's module: a
    transformers backbone's own `output_hidden_states=True`; the project's transformer (Megatron
    layouts, MegaMolBART), which has no such flag, through the package's layer states."""
    import torch

    backbone = getattr(loaded.encoder, "backbone", None)
    ids, mask = torch.from_numpy(np.asarray(input_ids)), torch.from_numpy(np.asarray(attention_mask))
    with torch.no_grad():
        if backbone is not None and hasattr(backbone, "config") and hasattr(backbone, "get_input_embeddings"):
            states = backbone(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        else:
            states = loaded.layer_states(ids, mask)
    return torch.stack([state.float() for state in states]).numpy()


def verify_layers(client, loaded, tasks: list[str], batches: list[list[str]], limits: tuple[float, float]
                  ) -> list[TaskCheck]:
    """layers: the first, a middle and the last layer of each batch, every pooling the model
    answers, against transformers' `output_hidden_states` pooled here by numpy over the residues."""
    from bionemo_export.serving.layers import has_bos_token

    if "layers" not in tasks:
        return []
    count = loaded.num_layers
    layers = [0, count // 2, -1]
    checks = []
    for batch in batches:
        encoded = loaded.tokenizer.encode(batch)
        states = reference_layer_states(loaded, encoded.input_ids, encoded.attention_mask)[[0, count // 2, count]]
        residues = encoded.residue_mask.astype(bool)
        has_bos = has_bos_token(loaded.tokenizer, batch[0])
        include = ["mean", "max", *(["bos"] if has_bos else []), "per_tok"]
        served = client.layer_embeddings(batch, layers, include)
        weights = residues[None, :, :, None]
        expected = {"embeddings": (states * weights).sum(2) / np.maximum(weights.sum(2), 1),
                    "embeddings_max": np.where(weights, states, -np.inf).max(2),
                    "embeddings_bos": states[:, :, 0]}
        comparisons = []
        for name, want in expected.items():
            if name in served:
                comparisons.append(compare_outputs(served[name], want.transpose(1, 0, 2)))
        hiddens, mask = served.get("hiddens"), served.get("mask")
        mask_exact = bool(mask is not None and mask.shape == residues.shape and np.array_equal(mask, residues))
        want = states.transpose(1, 0, 2, 3)
        if hiddens is None or hiddens.shape != want.shape:
            comparisons.append(Comparison(float("inf"), float("-inf"), f"served hiddens of shape "
                               f"{None if hiddens is None else list(hiddens.shape)}, expected {list(want.shape)}"))
        else:
            attention = encoded.attention_mask.astype(bool)
            comparisons.append(compare_outputs(hiddens.transpose(0, 2, 1, 3)[attention],
                                               want.transpose(0, 2, 1, 3)[attention]))
        found = Comparison(max(c.max_abs_error for c in comparisons), min(c.min_cosine for c in comparisons),
                           next((c.problem for c in comparisons if c.problem), None))
        checks.append(task_check(client.model("layers"), batch, found, mask_exact, limits,
                                  f"layers {layers}, {', '.join(include)} against output_hidden_states"))
    return checks
