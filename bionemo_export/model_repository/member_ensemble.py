"""The models of a checkpoint ensemble (models/members.py: several masked-LM checkpoints of one
family with one tokenizer, served as one model; ESM-1v's five seeds).

For `--name N` and K members (`m1` ... `mK`, in the order the checkpoints were given):

    N_tokenizer     python    (ensemble layout only) sequences -> token rows, shared by every member
    N_mi_encoder    graph     member i's encoder (fused layout: it tokenizes, as N_encoder does)
    N_mi_lm_head    graph     member i's masked-LM head: hiddens -> log_probs FP32 [-1, A]
    N_member_mean   python    log_probs_1 ... log_probs_K -> log_probs (their mean), member_log_probs
                              [K, -1, A] (serving/member_mean.py)
    N_logits        ensemble  sequences -> log_probs, mask, member_log_probs: every member's encoder
                              and head as steps of their own, which Triton runs side by side, then
                              N_member_mean
    N_scores        python    masked_lm.py's: it calls N_logits, so it scores the mean, which equals
                              the mean of the members' scores; and `member_scores` [K, V], each
                              member's, when a request asks for it (serving/scores.py)

Each member's graphs are exported and checked against its own PyTorch model like any build's
(graphs `mi_encoder`, `mi_lm_head` in manifest.json). A request costs K encoder passes: the
members' models run in parallel where the host has the cores (or GPUs) for them. In the Python
backend their ONNX Runtime "auto" thread counts are sized for the K members sharing the host's
cores (config parameter `models_sharing_cores`, serving/onnx_session.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bionemo_export.tasks import TASKS
from bionemo_export.tensors import DType, TensorSpec

from .encoder import ENSEMBLE_VERSION_NOTE, _encoder_model, _tokenizer_model, python_model
from .masked_lm import MaskedLMHead, lm_head_model, scores_model
from .options import ServingOptions
from .plan import EnsembleStep, ModelPlan

MEAN_MODEL = "member_mean"
"""N_member_mean: the model that averages the members' log-probabilities."""


@dataclass(frozen=True)
class MemberGraphs:
    """One member's exported graphs, as the planner needs them."""

    label: str
    """`m1`, `m2`, ...: its models are N_<label>_encoder and N_<label>_lm_head."""
    hidden_size: int
    encoder_files: dict[str, Path]
    lm_head_file: Path
    graph_optimization_level: str


def mean_model(name: str, members: int, alphabet: int, options: ServingOptions) -> ModelPlan:
    """N_member_mean: Python, one instance per tokenizer instance, no batcher of its own (it runs
    inside N_logits, on one request's members at a time; the work is a mean over K arrays)."""
    inputs = [TensorSpec(f"log_probs_{number}", DType.FP32, (-1, alphabet)) for number in range(1, members + 1)]
    outputs = [TensorSpec("log_probs", DType.FP32, (-1, alphabet)),
               *TASKS["logits"].member_tensors({"K": members, "A": alphabet})]
    model_name = f"{name}_{MEAN_MODEL}"
    served, code = python_model("models.MemberMeanModel", "member_mean", model_name=model_name, members=members,
                                logits_model=f"{name}_logits",
                                member_names=", ".join(f"{name}_m{n}" for n in range(1, members + 1)))
    return ModelPlan(
        name=model_name, inputs=inputs, outputs=outputs, max_batch_size=options.max_batch_size, backend="python",
        instance_count=options.tokenizer_instances, parameters={"members": str(members), **served}, files=code,
        description=f"the mean of the {members} members' log-probabilities (Python backend)")


def logits_ensemble(name: str, members: list[MemberGraphs], head: MaskedLMHead, options: ServingOptions) -> ModelPlan:
    """N_logits: each member's encoder and head as steps of their own, then N_member_mean."""
    alphabet = len(head.alphabet)
    steps: list[EnsembleStep] = []
    if not options.fused:  # one tokenizer for every member: the members share it (check_members)
        steps.append(EnsembleStep(f"{name}_tokenizer", {"sequences": "sequences"},
                                  {"input_ids": "input_ids", "attention_mask": "attention_mask", "mask": "mask"}))
    for number, member in enumerate(members, 1):
        prefix = f"{name}_{member.label}"
        hiddens = f"hiddens_{number}"
        if options.fused:  # member 1's mask is the public mask (every member tokenizes alike)
            steps.append(EnsembleStep(f"{prefix}_encoder", {"sequences": "sequences"},
                                      {"hiddens": hiddens, **({"mask": "mask"} if number == 1 else {})}))
        else:
            steps.append(EnsembleStep(f"{prefix}_encoder", {"input_ids": "input_ids",
                                                            "attention_mask": "attention_mask",
                                                            "residue_mask": "mask"}, {"hiddens": hiddens}))
        steps.append(EnsembleStep(f"{prefix}_lm_head", {"hiddens": hiddens}, {"log_probs": f"log_probs_{number}"}))
    steps.append(EnsembleStep(f"{name}_{MEAN_MODEL}",
                              {f"log_probs_{number}": f"log_probs_{number}" for number in range(1, len(members) + 1)},
                              {"log_probs": "log_probs", "member_log_probs": "member_log_probs"}))
    task = TASKS["logits"]
    outputs = [TensorSpec(t.name, t.dtype, t.shape({"A": alphabet})) for t in task.outputs]
    outputs += task.member_tensors({"K": len(members), "A": alphabet})
    model_name = task.model(name)
    return ModelPlan(
        name=model_name, inputs=[TensorSpec("sequences", DType.BYTES, (1,))], outputs=outputs,
        max_batch_size=options.max_batch_size, platform="ensemble",
        response_cache=options.role("logits").response_cache, steps=steps,
        parameters={"alphabet": json.dumps(list(head.alphabet)), "mask_char": head.mask_char or "",
                    "members": str(len(members))},
        files={"README.md": ENSEMBLE_VERSION_NOTE.format(name=model_name)},
        description=f"public: logits, the mean of {len(members)} members' log-probabilities")


def plan_member_ensemble(name: str, *, family: str, tokenizer, members: list[MemberGraphs], head: MaskedLMHead,
                         tasks: tuple[str, ...], options: ServingOptions) -> list[ModelPlan]:
    """Every model of an ensemble repository serving `tasks` (logits, and scores if asked)."""
    models = [] if options.fused else [_tokenizer_model(name, tokenizer, options)]
    for member in members:
        prefix = f"{name}_{member.label}"
        encoder = _encoder_model(prefix, family, member.hidden_size, tokenizer, member.encoder_files, options,
                                 member.graph_optimization_level)
        if "public_prefix" in encoder.parameters:  # errors name the public model's input
            encoder.parameters["public_prefix"] = name
        encoder.description = f"member {member.label}: {encoder.description}"
        lm_head = lm_head_model(prefix, member.hidden_size, MaskedLMHead(member.lm_head_file, head.alphabet,
                                                                          head.mask_char),
                                options, tokenizer.max_length)
        lm_head.description = f"member {member.label}: {lm_head.description}"
        if options.serving_backend.runs_python:  # ONNX Runtime's "auto" threads: the members share the cores
            for plan in (encoder, lm_head):
                plan.parameters["models_sharing_cores"] = str(len(members))
        models += [encoder, lm_head]
    models += [mean_model(name, len(members), len(head.alphabet), options), logits_ensemble(name, members, head,
                                                                                            options)]
    if "scores" in tasks:
        models.append(scores_model(name, head, options, members=len(members)))
    return models
