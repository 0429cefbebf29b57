"""Masked-LM heads: the part of a masked language model that turns the encoder's last hidden
states into log-probabilities over the residue alphabet (served as `N_logits`, and the basis of
`N_scores`).

Every family's head is the same computation, only named differently in its checkpoints
(docs/reference/scoring.md, "Masked-LM heads in checkpoints"):

    logits    = decoder(layer_norm(act(dense(hiddens)))) + bias     over the whole vocabulary
    log_probs = log_softmax(logits[..., alphabet ids])               over the alphabet only

- Hugging Face `EsmForMaskedLM`: `lm_head.dense`, exact GELU, `lm_head.layer_norm`, decoder tied to
  the word embeddings (`lm_head.decoder.weight` may or may not be in the file), `lm_head.bias`.
- BioNeMo ESM-2nv / ESM-1nv `.nemo`: `model.lm_head.dense`, GELU (NeMo's BertLMHead: exact, tanh
  with `openai_gelu`), `model.lm_head.layernorm`, output weights = the word embeddings,
  `model.lm_head.bias` padded to 128 rows (cut to the vocabulary like the embeddings).
- BERT (`BertForMaskedLM`, `BertForPreTraining`, AntiBERTy, rxnfp): `cls.predictions.transform.dense`,
  `config.hidden_act`, `cls.predictions.transform.LayerNorm`, `cls.predictions.decoder` (weight tied
  to the word embeddings unless `tie_word_embeddings` is false) + `cls.predictions.bias`.

A family's reader renames its keys into HEAD_KEYS (plus the optional `decoder.weight`) and
`build_lm_head` checks them strictly and builds `MaskedLMHead`. The softmax runs over the
alphabet's token ids only: the model's special tokens (`<cls>`, `<mask>`, `[PAD]`, ...) are
excluded, as AntiBERTy's runner excludes them, so that the log-probabilities of a row sum to 1 over
the residues a user can ask about. Only the alphabet's rows of the decoder are kept: the result is
the same as setting the other logits to -inf, with a smaller graph.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from bionemo_export.errors import InvalidInputError
from bionemo_export.models.readers import CheckpointError
from bionemo_export.models.readers.base import some as _some

HEAD_KEYS = ("dense.weight", "dense.bias", "layer_norm.weight", "layer_norm.bias", "bias")
"""The head's weights every checkpoint must give, under these normalized names."""
OPTIONAL_HEAD_KEYS = ("decoder.weight",)
"""An untied output projection; without it (or when tied) the word embeddings are used."""

ACTIVATIONS = {"gelu": "none", "gelu_tanh": "tanh"}
"""Head activations: exact GELU, or its tanh approximation (torch's `approximate`)."""
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_fast": "gelu_tanh"}
"""transformers' `hidden_act` names -> ACTIVATIONS."""


class MaskedLMHead(torch.nn.Module):
    """forward(hiddens FP32 [batch, length, hidden]) -> log_probs FP32 [batch, length, alphabet].

    dense -> GELU -> layer norm -> the decoder rows of the alphabet's tokens (+ their bias) ->
    log_softmax over the alphabet. Tensor operations only, so one exported graph serves every
    batch and length. `alphabet` and `alphabet_ids` say what the last axis holds.
    """

    def __init__(self, hidden_size: int, alphabet: Sequence[str], alphabet_ids: Sequence[int], *,
                 layer_norm_eps: float, activation: str = "gelu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise InvalidInputError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
        if len(alphabet) != len(alphabet_ids) or not alphabet:
            raise InvalidInputError(f"alphabet ({len(alphabet)}) and alphabet_ids ({len(alphabet_ids)}) must be as "
                                    "long, and not empty")
        self.alphabet = tuple(alphabet)
        self.alphabet_ids = tuple(int(i) for i in alphabet_ids)
        self.activation = activation
        self.approximate = ACTIVATIONS[activation]
        self.dense = torch.nn.Linear(hidden_size, hidden_size)
        self.layer_norm = torch.nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.decoder = torch.nn.Linear(hidden_size, len(self.alphabet))

    def forward(self, hiddens: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.gelu(self.dense(hiddens.float()), approximate=self.approximate)
        return torch.log_softmax(self.decoder(self.layer_norm(x)), dim=-1)


def build_lm_head(weights: Mapping[str, torch.Tensor], word_embeddings: torch.Tensor, *,
                  alphabet: Sequence[str], alphabet_ids: Sequence[int], layer_norm_eps: float,
                  activation: str, tied: bool, source: str, names: Mapping[str, str] | None = None) -> MaskedLMHead:
    """The head from `weights` (HEAD_KEYS, optionally `decoder.weight`), checked strictly.

    `word_embeddings` [vocab, hidden] (already cut to the vocabulary) are the output weights when
    `tied` or when `decoder.weight` is absent. `bias` must have at least the vocabulary's rows (a
    padded one is cut). `names` maps normalized names back to the checkpoint's, for messages.
    Raises CheckpointError naming `source` for missing, unexpected or mis-shaped keys.
    """
    names = dict(names or {})

    def shown(key: str) -> str:
        """`key` as the checkpoint names it."""
        return names.get(key, key)

    vocab, hidden = word_embeddings.shape
    problems = []
    if missing := [shown(key) for key in HEAD_KEYS if key not in weights]:
        problems.append(f"missing keys: {_some(missing)}")
    if unexpected := sorted(shown(key) for key in weights if key not in HEAD_KEYS + OPTIONAL_HEAD_KEYS):
        problems.append(f"unexpected keys: {_some(unexpected)}")
    expected = {"dense.weight": (hidden, hidden), "dense.bias": (hidden,), "layer_norm.weight": (hidden,),
                "layer_norm.bias": (hidden,), "decoder.weight": (vocab, hidden)}
    shapes = [f"{shown(key)} is {tuple(weights[key].shape)}, expected {shape}"
              for key, shape in expected.items() if key in weights and tuple(weights[key].shape) != shape]
    bias = weights.get("bias")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] < vocab):
        shapes.append(f"{shown('bias')} is {tuple(bias.shape)}, expected ({vocab},) (or padded further)")
    if shapes:
        problems.append(f"wrong shapes: {_some(shapes)}")
    if problems:
        raise CheckpointError(f"{source}: the masked-LM head does not match the model: " + "; ".join(problems)
                              + ". Fix or remove the head's keys (a checkpoint without them loads with no head)")
    if bad := [i for i in alphabet_ids if not 0 <= int(i) < vocab]:
        raise CheckpointError(f"{source}: alphabet token ids {bad} are outside the {vocab}-token vocabulary")
    output = word_embeddings if tied or "decoder.weight" not in weights else weights["decoder.weight"]
    rows = torch.tensor([int(i) for i in alphabet_ids], dtype=torch.long)
    head = MaskedLMHead(hidden, alphabet, alphabet_ids, layer_norm_eps=layer_norm_eps, activation=activation)
    with torch.no_grad():
        head.dense.weight.copy_(weights["dense.weight"].float())
        head.dense.bias.copy_(weights["dense.bias"].float())
        head.layer_norm.weight.copy_(weights["layer_norm.weight"].float())
        head.layer_norm.bias.copy_(weights["layer_norm.bias"].float())
        head.decoder.weight.copy_(output.float()[rows])
        assert bias is not None  # one of HEAD_KEYS, so a missing bias raised above
        head.decoder.bias.copy_(bias.float()[:vocab][rows])
    return head.eval()


def huggingface_activation(hidden_act: object, source: str) -> str:
    """The head activation for a transformers config's `hidden_act`; CheckpointError for others."""
    if isinstance(hidden_act, str) and hidden_act in HF_ACTIVATIONS:
        return HF_ACTIVATIONS[hidden_act]
    raise CheckpointError(f"{source}: hidden_act {hidden_act!r} is not supported for the masked-LM head "
                          f"(supported: {', '.join(sorted(HF_ACTIVATIONS))})")


@dataclass
class HeadWeights:
    """A checkpoint's masked-LM head as a family's reader found it (ModelDescription.lm_head):
    the weights under HEAD_KEYS names and how to build it (see build_lm_head)."""

    weights: dict[str, torch.Tensor]
    names: dict[str, str]
    """Normalized name -> the checkpoint's key, for messages."""
    activation: str
    layer_norm_eps: float
    tied: bool = True
    """Output weights = the word embeddings (else the checkpoint's `decoder.weight`)."""


def split_head(weights: Mapping[str, torch.Tensor], prefix: str, renames: Mapping[str, str], source: str
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, str]]:
    """(the other weights, the head's weights under normalized names, normalized -> original
    names) of a state dict whose head keys start with `prefix`; `renames` maps a key's rest after
    the prefix to its normalized name (rests not in it keep their name, and are then reported as
    unexpected by build_lm_head); the names cover the HEAD_KEYS missing from the file too."""
    rest: dict[str, torch.Tensor] = {}
    head: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    for key, tensor in weights.items():
        if not key.startswith(prefix):
            rest[key] = tensor
            continue
        name = renames.get(key[len(prefix):], key[len(prefix):])
        if name in head:
            raise CheckpointError(f"{source}: {names[name]} and {key} are both the masked-LM head's {name}")
        head[name], names[name] = tensor, key
    if head:  # the names missing keys would have, for messages
        inverse = {new: old for old, new in renames.items()}
        for name in HEAD_KEYS + OPTIONAL_HEAD_KEYS:
            names.setdefault(name, prefix + inverse.get(name, name))
    return rest, head, names
