"""ESM's contact head: residue-residue contact probabilities from the attention of every layer
(served as `N_contacts`).

Hugging Face `EsmModel` (and so `EsmForMaskedLM`, under `esm.`) carries it as
`contact_head.regression.weight` [1, layers x heads] and `.bias` [1]: a logistic regression over
the attention maps of every head of every layer (Rao et al. 2020, ESM's `ContactPredictionHead`):

    attentions  [B, layers, heads, T, T]   softmax probabilities, zero on padding rows and columns
                                           and on the EOS token's row and column
    features    = the T-2 inner tokens (the BOS and the last position cut), layers x heads channels,
                  symmetrized (A + A^T), then average-product corrected (A - rowsum x colsum / sum)
    contacts    = sigmoid(regression(features))        [B, T-2, T-2]

For a tokenizer that writes BOS + residues + EOS (every ESM tokenizer), row and column i of a
sequence's map are its residue i; positions past its own length (padding, its EOS) are
don't-care. The padding of a batch changes nothing in a sequence's own [L, L] block: zeroed rows
and columns add nothing to the sums of the correction.

`ContactPredictor` computes it from the same weights as the encoder (shared, not copied), in a
copy of the backbone's module tree that runs transformers' eager attention: the encoder's own
module (and its exported graph) keeps its fused attention, which returns no probabilities. Only
the contacts graph computes the probabilities, one layer at a time (see ContactPredictor).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from bionemo_export.models.readers import CheckpointError
from bionemo_export.models.readers.base import some as _some

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CONTACT_KEYS = ("regression.weight", "regression.bias")
"""The head's weights, under the names after the checkpoint's `contact_head.` prefix."""


@dataclass
class ContactWeights:
    """A checkpoint's contact head as a family's reader found it (ModelDescription.contact_head)."""

    weights: dict[str, torch.Tensor]
    """CONTACT_KEYS -> tensors."""
    names: dict[str, str]
    """CONTACT_KEYS -> the checkpoint's own key, for messages."""


class ContactPredictor(torch.nn.Module):
    """forward(input_ids INT64 [B, T], attention_mask INT64 [B, T]) -> contacts FP32 [B, T-2, T-2].

    `backbone` is a transformers EsmModel running eager attention, whose self-attention modules
    (`encoder.layer[i].attention.self`) return the attention probabilities [B, heads, T, T] as the
    second item of their output; `eos_id` the tokenizer's EOS token, whose attention rows and
    columns are zeroed as ESM's head does.

    Each layer's probabilities are reduced as soon as that layer has computed them (a forward hook
    on its self-attention): masked, cut to the residues, symmetrized, corrected, and summed over
    its heads with their regression weights into one [B, L, L] term. The logistic regression is a
    sum over the layers x heads channels, so the result is the head's; but the graph never holds
    more than one layer's probabilities (ESM-2 650M at 1022 residues: 84 MB instead of 2.8 GB for
    all 660 maps), as ONNX Runtime frees each once its term is computed."""

    backbone: PreTrainedModel
    regression: torch.nn.Linear

    def __init__(self, backbone: PreTrainedModel, regression: torch.nn.Linear, eos_id: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.regression = regression
        self.eos_id = int(eos_id)
        self._pairs: torch.Tensor | None = None
        self._terms: list[torch.Tensor] = []
        layers = cast(Any, backbone).encoder.layer
        self.heads = int(backbone.config.num_attention_heads)
        if regression.in_features != len(layers) * self.heads:
            raise ValueError(f"the contact head takes {regression.in_features} channels; the model has "
                             f"{len(layers)} layers x {self.heads} heads")
        for index, layer in enumerate(layers):
            layer.attention.self.register_forward_hook(self._hook(index))

    def _hook(self, index: int):
        def reduce(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self._pairs is not None:  # only inside this module's forward (the twin is its own)
                self._terms.append(self.layer_term(index, output[1]))
        return reduce

    def layer_term(self, index: int, attentions: torch.Tensor) -> torch.Tensor:
        """One layer's part of the regression: its probabilities [B, heads, T, T] -> [B, L, L]."""
        assert self._pairs is not None
        features = (attentions.float() * self._pairs[:, None])[..., 1:-1, 1:-1]
        features = features + features.transpose(-1, -2)
        rows = features.sum(-1, keepdim=True)
        columns = features.sum(-2, keepdim=True)
        total = features.sum((-1, -2), keepdim=True)
        # An empty sequence's block is all zeros: divide by 1 there rather than produce NaN.
        total = torch.where(total > 0, total, torch.ones_like(total))
        features = features - rows * columns / total
        weights = self.regression.weight[0, index * self.heads:(index + 1) * self.heads]
        return torch.einsum("bhij,h->bij", features, weights)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        keep = attention_mask.float() * input_ids.ne(self.eos_id).float()
        self._pairs, self._terms = keep[:, :, None] * keep[:, None, :], []
        try:
            self.backbone(input_ids=input_ids, attention_mask=attention_mask)
            terms = self._terms
        finally:
            self._pairs, self._terms = None, []
        if len(terms) != len(cast(Any, self.backbone).encoder.layer):
            raise RuntimeError(f"the contact head got the attention of {len(terms)} layers")
        logits = terms[0]
        for term in terms[1:]:
            logits = logits + term
        return torch.sigmoid(logits + self.regression.bias[0])


def eager_copy(backbone: torch.nn.Module) -> PreTrainedModel:
    """A second module tree of a transformers `backbone` that runs eager attention (which returns
    the attention probabilities), sharing every parameter and buffer with it: no weights are
    copied, and `backbone` itself is left as it was."""
    config = copy.deepcopy(cast("PreTrainedModel", backbone).config)
    config._attn_implementation = "eager"
    settings = {}
    if "add_pooling_layer" in inspect.signature(type(backbone).__init__).parameters:  # ESM, BERT; not T5, ESM C
        settings["add_pooling_layer"] = getattr(backbone, "pooler", None) is not None
    with torch.device("meta"):  # everything is taken from `backbone` below
        twin = cast("PreTrainedModel", cast(Any, type(backbone))(config, **settings))
    # every name of a tied weight (T5's shared embedding is also encoder.embed_tokens)
    for name, parameter in backbone.named_parameters(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        twin.get_submodule(owner)._parameters[leaf] = parameter
    for name, buffer in backbone.named_buffers(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        twin.get_submodule(owner)._buffers[leaf] = buffer
    left = [name for name, tensor in (*twin.named_parameters(), *twin.named_buffers()) if tensor.is_meta]
    if left:  # a backbone whose constructor makes tensors its own tree does not have
        raise RuntimeError(f"the eager copy of {type(backbone).__name__} lacks {_some(left)}")
    return twin.eval()


def build_contact_predictor(head: ContactWeights, backbone: torch.nn.Module, *, layers: int, heads: int,
                            eos_id: int | None, source: str) -> ContactPredictor:
    """The contact head `head` over `backbone`'s attention (layers x heads channels), checked
    strictly; CheckpointError naming `source` for missing, unexpected or mis-shaped keys."""

    def shown(key: str) -> str:
        return head.names.get(key, f"contact_head.{key}")

    problems = []
    if missing := [shown(key) for key in CONTACT_KEYS if key not in head.weights]:
        problems.append(f"missing keys: {_some(missing)}")
    if unexpected := sorted(shown(key) for key in head.weights if key not in CONTACT_KEYS):
        problems.append(f"unexpected keys: {_some(unexpected)}")
    expected = {"regression.weight": (1, layers * heads), "regression.bias": (1,)}
    if shapes := [f"{shown(key)} is {tuple(head.weights[key].shape)}, expected {shape} ({layers} layers x {heads} "
                  "heads)" for key, shape in expected.items()
                  if key in head.weights and tuple(head.weights[key].shape) != shape]:
        problems.append(f"wrong shapes: {_some(shapes)}")
    if eos_id is None:
        problems.append("the tokenizer has no EOS token, whose attention the head leaves out")
    if problems:
        raise CheckpointError(f"{source}: the contact head does not match the model: " + "; ".join(problems)
                              + ". Fix or remove the contact_head keys (a checkpoint without them serves no "
                              "contacts)")
    assert eos_id is not None
    regression = torch.nn.Linear(layers * heads, 1)
    with torch.no_grad():
        regression.weight.copy_(head.weights["regression.weight"].float())
        regression.bias.copy_(head.weights["regression.bias"].float())
    return ContactPredictor(eager_copy(backbone), regression, eos_id).float().eval()


def split_contact_head(weights: Mapping[str, torch.Tensor], prefix: str, stored: Mapping[str, str] | None = None
                       ) -> tuple[dict[str, torch.Tensor], ContactWeights | None]:
    """(the other weights, the contact head or None) of a state dict (names already normalized)
    whose contact head's keys start with `prefix`; `stored` maps normalized names back to the
    checkpoint's keys, for messages."""
    stored = stored or {}
    rest = {key: tensor for key, tensor in weights.items() if not key.startswith(prefix)}
    found = {key[len(prefix):]: (key, tensor) for key, tensor in weights.items() if key.startswith(prefix)}
    if not found:
        return rest, None
    return rest, ContactWeights({name: tensor for name, (_, tensor) in found.items()},
                                {name: stored.get(key, key) for name, (key, _) in found.items()})
