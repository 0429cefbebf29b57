"""The models of the masked-LM tasks (a checkpoint with a masked-LM head): N_logits and N_scores.

For `--name N`, on top of the encoder models (encoder.py):

    N_lm_head  graph     hiddens FP32 [-1, H] -> log_probs FP32 [-1, A]
                         (the exported head, lm_head.onnx: dense -> GELU -> layer norm -> decoder,
                         log_softmax over the alphabet; run by the backend, backends.py: in the
                         Python backend every position of every request is joined into one run,
                         serving/positionwise.py, the head mixing no positions)
    N_logits   ensemble  sequences -> log_probs, mask    (the encoder's steps, then N_lm_head)
    N_scores   python    sequences (+ optional variants, method) -> scores FP32 [-1]
                         (masked copies formed and batched here, sent to N_logits through BLS:
                         serving/scores.py, serving/scoring.py)

`A` is the residue alphabet (LoadedModel.alphabet): the config `parameters` of N_logits and
N_scores carry it as a JSON list, with the mask character the tokenizer reads (`_`). N_scores is
planned only where LoadedModel.serves_scores (one character per residue, a mask character).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bionemo_export.serving.parameters import BLS_MODELS
from bionemo_export.serving.scoring import ScoringLimits
from bionemo_export.tasks import TASKS
from bionemo_export.tensors import DType, TensorSpec

from .backends import GraphModel, ShapeRange
from .encoder import ensemble_model, python_model
from .options import ServingOptions
from .plan import EnsembleStep, ModelPlan

MASKED_LM_TASKS = ("logits", "scores")
"""The tasks whose models this module plans."""


@dataclass(frozen=True)
class MaskedLMHead:
    """What the planner needs of a checkpoint's masked-LM head."""

    onnx_file: Path
    """The exported head graph (exporters/lm_head.py)."""
    alphabet: tuple[str, ...]
    """log_probs' last axis, in order."""
    mask_char: str | None
    """The character the tokenizer reads as the mask token (None: no mask token)."""
    default_method: str = "wt-marginal"
    """N_scores' method for variants when a request names none (the family's `scoring_default`)."""
    structure_aware: bool = False
    """Sequences are SaProt's structure-aware ones: N_scores reads wild types with the tokenizer's
    module (in the served package) and sends structure-aware copies."""


def lm_head_model(name: str, hidden_size: int, head: MaskedLMHead, options: ServingOptions,
                  max_length: int) -> ModelPlan:
    """N_lm_head: the head graph, batched like the encoder (ragged rows in the Python backend)."""
    role = options.role("lm_head")
    backend = options.serving_backend
    inputs = [TensorSpec("hiddens", DType.FP32, (-1, hidden_size), ragged=backend.runs_python)]
    outputs = [TensorSpec("log_probs", DType.FP32, (-1, len(head.alphabet)))]
    plan = ModelPlan(name=f"{name}_lm_head", inputs=inputs, outputs=outputs, max_batch_size=options.max_batch_size,
                     dynamic_batching=role.batching)
    shapes = ShapeRange(axes={"hiddens": ("batch", "length", hidden_size)},
                        sizes={"batch": (1, options.max_batch_size), "length": (1, max_length)},
                        split_axis="length", bucket=options.length_bucket or 16, opt={"batch": options.max_batch_size})

    backend.plan_graph(GraphModel(
        plan, role, "masked-LM head", {"model.onnx": head.onnx_file}, shapes,
        lambda: python_model("models.PositionwiseModel", "positionwise", model_name=plan.name,
                             what="masked-LM head", input_name="hiddens", output_name="log_probs",
                             width=hidden_size, output_width=len(head.alphabet)),
        python_parameters={"token_budget": str(role.token_budget or options.token_budget or 8192)}))
    return plan


def logits_ensemble(name: str, head: MaskedLMHead, options: ServingOptions) -> ModelPlan:
    """N_logits: the encoder's steps (hiddens and mask), then N_lm_head."""
    task = TASKS["logits"]
    outputs = [TensorSpec(t.name, t.dtype, t.shape({"A": len(head.alphabet)})) for t in task.outputs]
    plan = ensemble_model(name, task.name, outputs, options, {"hiddens": "hiddens", "mask": "mask"},
                          after=[EnsembleStep(f"{name}_lm_head", {"hiddens": "hiddens"}, {"log_probs": "log_probs"})])
    plan.parameters = {"alphabet": json.dumps(list(head.alphabet)), "mask_char": head.mask_char or ""}
    return plan


def scores_model(name: str, head: MaskedLMHead, options: ServingOptions,
                 limits: ScoringLimits = ScoringLimits(), members: int = 0) -> ModelPlan:
    """N_scores: the Python model that forms the masked copies and calls N_logits through BLS.
    `members`: a checkpoint ensemble's count (member_ensemble.py), which adds the output
    `member_scores` [K, V]; 0: one checkpoint."""
    task = TASKS["scores"]
    logits = f"{name}_logits"
    served, code = python_model("models.ScoresModel", "scores", model_name=task.model(name), logits_model=logits,
                                members=members)
    plan = ModelPlan.public_python(
        task, name, options.role("scores"), options.max_batch_size,
        parameters={BLS_MODELS: logits, "logits_model": logits, "alphabet": json.dumps(list(head.alphabet)),
                    "mask_char": head.mask_char or "", "max_batch_size": str(options.max_batch_size),
                    "default_method": head.default_method, "structure_aware": str(head.structure_aware).lower(),
                    **limits.parameters(), **({"members": str(members)} if members else {}), **served},
        files=code,
        description="public: scores (Python, BLS to the log-probabilities)",
    )
    if members:
        plan.outputs += task.member_tensors({"K": members})
    return plan


def plan_masked_lm_models(name: str, *, hidden_size: int, head: MaskedLMHead, tasks: tuple[str, ...],
                          options: ServingOptions, max_length: int) -> list[ModelPlan]:
    """The models `tasks` (among MASKED_LM_TASKS) need, to add to the encoder repository's plan."""
    wanted = [task for task in tasks if task in MASKED_LM_TASKS]
    if not wanted:
        return []
    models = [lm_head_model(name, hidden_size, head, options, max_length), logits_ensemble(name, head, options)]
    if "scores" in wanted:
        models.append(scores_model(name, head, options))
    return models
