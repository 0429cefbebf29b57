"""Every layer's attention probabilities as one graph (served as `N_attentions` through
`N_attention_graph`).

    forward(input_ids, attention_mask INT64 [B, T]) -> attentions_1, ..., attentions_N FP32 [B, heads, T, T]

`attentions_i` is block i's softmax probabilities (query rows, key columns), transformers'
`output_attentions=True` (its i-1-th item): the numbering of the layers task, where block i's
output is `hiddens_i`; the embedding layer (0) has no attention. Rows and columns are tokens, the
tokenizer's BOS and EOS included, as `N_hiddens` lays them out.

Computed by a second module tree of the family's transformers backbone running eager attention
(contact_head.eager_copy: the weights are shared, not copied): the encoder and its graph keep
their fused attention, which returns no probabilities. Each layer is a separate named output, so
that a caller fetches only the layers it asks for; the graph still runs every block (ONNX Runtime
does not prune a graph per run).

Checkpoints read into the project's own transformer (the Megatron layouts of ESM-1nv and
ProtT5nv, MegaMolBART) have no eager twin and so no attentions task.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from bionemo_export.models.contact_head import eager_copy
from bionemo_export.tensors import DType, TensorSpec


def attention_output_name(layer: int) -> str:
    """The attentions graph's output holding block `layer`'s probabilities (1..N)."""
    return f"attentions_{layer}"


def attention_outputs(num_layers: int, num_heads: int) -> tuple[TensorSpec, ...]:
    """The attentions graph's outputs: attentions_1 .. attentions_N, each [batch, heads, length, length]
    (its inputs are base.LAYER_INPUTS; serving/attentions.py names the outputs the same way)."""
    return tuple(TensorSpec(attention_output_name(i), DType.FP32, ("batch", num_heads, "length", "length"))
                 for i in range(1, num_layers + 1))


def returns_attentions(backbone: torch.nn.Module) -> bool:
    """Whether `backbone` is a transformers model, whose eager attention answers its probabilities
    (`output_attentions=True`); the project's own transformer does not."""
    from transformers import PreTrainedModel

    return isinstance(backbone, PreTrainedModel)


class AttentionMaps(torch.nn.Module):
    """forward(input_ids, attention_mask) -> (attentions_1, ..., attentions_N) of a transformers
    `backbone`, computed by its eager twin (the same weights)."""

    def __init__(self, backbone: torch.nn.Module, num_layers: int) -> None:
        super().__init__()
        if not returns_attentions(backbone):
            raise ValueError(f"{type(backbone).__name__} is not a transformers model: it answers no attention "
                             "probabilities")
        self.backbone = eager_copy(backbone)
        self.num_layers = int(num_layers)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        output = cast(Any, self.backbone)(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True)
        attentions = output.attentions
        if attentions is None or len(attentions) != self.num_layers:
            found = 0 if attentions is None else len(attentions)
            raise RuntimeError(f"the backbone answered the attention of {found} blocks; it has {self.num_layers}")
        return tuple(attention.float() for attention in attentions)
