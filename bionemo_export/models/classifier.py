"""Fine-tuned heads: the classification or regression layer a checkpoint fine-tuned on a task puts
on top of the encoder (served as `N_predictions`).

Two computations cover the four Hugging Face classes (docs/reference/scoring.md, "Fine-tuned
heads"), dropout being the identity at inference:

    sequence heads  logits = out(tanh(dense(hiddens[:, 0])))       [batch, C]
        BertForSequenceClassification: `bert.pooler.dense` pools [CLS], then `classifier`
        EsmForSequenceClassification: `classifier.dense` -> tanh -> `classifier.out_proj` on <cls>
    token heads     logits = out(hiddens)                           [batch, length, C]
        BertForTokenClassification, EsmForTokenClassification: `classifier` on every token

A family's reader takes the head's keys out of the state dict under the normalized names of
SEQUENCE_KEYS / TOKEN_KEYS (ClassifierWeights), and `build_classifier` checks them strictly.

The outputs are described by the config: `num_labels` (C), `id2label` (real configs may name fewer
labels than num_labels: rxnfp's bert_ft_10k_25s has 50 and names 2; the others are `LABEL_i`, as
transformers fills them) and `problem_type` (single_label_classification,
multi_label_classification or regression; when absent, transformers' rule: regression for one
label, else single-label classification).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bionemo_export.errors import InvalidInputError
from bionemo_export.models.readers import CheckpointError
from bionemo_export.models.readers.base import some as _some

PROBLEM_TYPES = ("single_label_classification", "multi_label_classification", "regression")
SEQUENCE_KEYS = ("dense.weight", "dense.bias", "out.weight", "out.bias")
"""A sequence head's weights under normalized names (dense = pooler / classifier.dense)."""
TOKEN_KEYS = ("out.weight", "out.bias")
"""A token head's weights under normalized names."""


class ClassifierHead(torch.nn.Module):
    """forward(hiddens FP32 [batch, length, hidden]) -> logits FP32 [batch, C] (sequence heads: the
    first position, dense -> tanh -> out) or [batch, length, C] (`per_token`: out at every position).

    `labels` (C names), `problem_type` and `per_token` say what the logits mean."""

    def __init__(self, hidden_size: int, labels: Sequence[str], *, problem_type: str, per_token: bool) -> None:
        super().__init__()
        if problem_type not in PROBLEM_TYPES:
            raise InvalidInputError(f"problem_type {problem_type!r} is not one of {', '.join(PROBLEM_TYPES)}")
        if not labels:
            raise InvalidInputError("a classifier head needs at least one label")
        self.labels = tuple(labels)
        self.problem_type = problem_type
        self.per_token = bool(per_token)
        self.dense = None if per_token else torch.nn.Linear(hidden_size, hidden_size)
        self.out = torch.nn.Linear(hidden_size, len(self.labels))

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def forward(self, hiddens: torch.Tensor) -> torch.Tensor:
        hiddens = hiddens.float()
        if self.per_token:
            return self.out(hiddens)
        assert self.dense is not None  # a sequence head has its dense layer (__init__)
        return self.out(torch.tanh(self.dense(hiddens[:, 0])))


@dataclass
class ClassifierWeights:
    """A checkpoint's fine-tuned head as a family's reader found it (ModelDescription.classifier)."""

    weights: dict[str, torch.Tensor]
    """Under SEQUENCE_KEYS / TOKEN_KEYS names."""
    names: dict[str, str]
    """Normalized name -> the checkpoint's key, for messages."""
    labels: tuple[str, ...]
    problem_type: str
    per_token: bool


def config_labels(config: Mapping[str, Any], source: str) -> tuple[tuple[str, ...], str]:
    """(labels, problem_type) of a Hugging Face config.json (as a dict): `num_labels` names
    (id2label, `LABEL_i` for the ids it leaves out) and the problem type."""
    raw = config.get("id2label") or {}
    try:
        id2label = {int(key): str(value) for key, value in raw.items()}
    except (TypeError, ValueError, AttributeError):
        raise CheckpointError(f"{source}: id2label must map label ids to names, got {raw!r}") from None
    count = config.get("num_labels")
    count = int(count) if count is not None else (max(id2label) + 1 if id2label else 2)
    if count < 1:
        raise CheckpointError(f"{source}: num_labels is {count}")
    if bad := sorted(i for i in id2label if not 0 <= i < count):
        raise CheckpointError(f"{source}: id2label names ids {bad} outside num_labels {count}")
    labels = tuple(id2label.get(i, f"LABEL_{i}") for i in range(count))
    problem_type = config.get("problem_type") or ("regression" if count == 1 else "single_label_classification")
    if problem_type not in PROBLEM_TYPES:
        raise CheckpointError(f"{source}: problem_type {problem_type!r} is not one of {', '.join(PROBLEM_TYPES)}")
    return labels, problem_type


def build_classifier(head: ClassifierWeights, hidden_size: int, source: str) -> ClassifierHead:
    """The head from its weights, checked strictly: every key of its kind present, nothing else,
    shapes [H, H] / [H] for dense and [C, H] / [C] for out, C = len(labels). CheckpointError
    naming `source` otherwise."""
    def shown(key: str) -> str:
        """`key` as the checkpoint names it."""
        return head.names.get(key, key)

    keys = TOKEN_KEYS if head.per_token else SEQUENCE_KEYS
    weights, count = head.weights, len(head.labels)
    problems = []
    if missing := [shown(key) for key in keys if key not in weights]:
        problems.append(f"missing keys: {_some(missing)}")
    if unexpected := sorted(shown(key) for key in weights if key not in keys):
        problems.append(f"unexpected keys: {_some(unexpected)}")
    expected = {"dense.weight": (hidden_size, hidden_size), "dense.bias": (hidden_size,),
                "out.weight": (count, hidden_size), "out.bias": (count,)}
    if shapes := [f"{shown(key)} is {tuple(weights[key].shape)}, expected {shape}"
                  for key, shape in expected.items() if key in weights and tuple(weights[key].shape) != shape]:
        problems.append(f"wrong shapes: {_some(shapes)} (num_labels is {count})")
    if problems:
        kind = "token" if head.per_token else "sequence"
        raise CheckpointError(f"{source}: the {kind}-classification head does not match the model: "
                              + "; ".join(problems))
    module = ClassifierHead(hidden_size, head.labels, problem_type=head.problem_type, per_token=head.per_token)
    with torch.no_grad():
        for key in keys:
            layer, what = key.split(".")
            getattr(getattr(module, layer), what).copy_(weights[key].float())
    return module.eval()


def classifier_kind(config: Mapping[str, Any]) -> str | None:
    """"sequence", "token" or None: what config.json's `architectures` say the checkpoint is."""
    for architecture in config.get("architectures") or ():
        if str(architecture).endswith("ForSequenceClassification"):
            return "sequence"
        if str(architecture).endswith("ForTokenClassification"):
            return "token"
    return None


def split_classifier(weights: Mapping[str, torch.Tensor], prefix: str, renames: Mapping[str, str]
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, str]]:
    """(the other weights, the head's weights under normalized names, normalized -> original) of a
    state dict whose backbone prefix is already stripped: the head's keys are those in `renames`
    (key -> normalized name) and any other starting with `prefix` (kept under its own name, so
    that build_classifier reports it as unexpected)."""
    rest: dict[str, torch.Tensor] = {}
    head: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    for key, tensor in weights.items():
        if key in renames or key.startswith(prefix):
            name = renames.get(key, key)
            head[name], names[name] = tensor, key
        else:
            rest[key] = tensor
    for key, name in renames.items():
        names.setdefault(name, key)
    return rest, head, names
