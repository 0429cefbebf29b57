"""Every layer's hidden states as one graph (served as `N_layers` through `N_layer_graph`).

    forward(input_ids, attention_mask INT64 [B, T]) -> hiddens_0, ..., hiddens_N FP32 [B, T, H]

ESM's numbering (fair-esm's `repr_layers`, transformers' `output_hidden_states`): `hiddens_0` is
the embedding layer's output, `hiddens_i` the output of block i, `hiddens_N` the last block's after
the model's final layer norm, which is what the encoder graph answers as `hiddens` (ESM's
`emb_layer_norm_after`, T5's `final_layer_norm`, ESM C's `norm`, the Megatron layouts'
`final_layernorm`; BERT has none: its last block's output). Transformers backbones answer their own
`hidden_states`; the project's transformer (Megatron layouts, MegaMolBART's encoder) collects each
block's output the same way (models/transformer.py `encode_layers`).

Each layer is a separate named output, so that a caller fetches only the layers it asks for (ONNX
Runtime and Triton's onnxruntime backend copy out only the requested outputs; the graph itself
still runs every block up to the last, as ONNX Runtime does not prune a graph per run).
"""

from __future__ import annotations

from typing import Any, cast

import torch

from bionemo_export.tensors import DType, TensorSpec


def layer_output_name(layer: int) -> str:
    """The layers graph's output holding layer `layer` (0..N)."""
    return f"hiddens_{layer}"


def layer_outputs(num_layers: int, hidden_size: int) -> tuple[TensorSpec, ...]:
    """The layers graph's outputs: hiddens_0 .. hiddens_N, each [batch, length, hidden] (its inputs
    are base.LAYER_INPUTS; serving/layers.py names the outputs the same way)."""
    return tuple(TensorSpec(layer_output_name(i), DType.FP32, ("batch", "length", hidden_size))
                 for i in range(num_layers + 1))


class LayerStates(torch.nn.Module):
    """forward(input_ids, attention_mask) -> (hiddens_0, ..., hiddens_N) of `encoder` (a family's
    encoder module with a `layer_states` method: encoder.PooledEncoder, MegaMolBartEncoder),
    whose weights it shares."""

    def __init__(self, encoder: torch.nn.Module, num_layers: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.num_layers = int(num_layers)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        states = cast(Any, self.encoder).layer_states(input_ids, attention_mask)
        if len(states) != self.num_layers + 1:
            raise RuntimeError(f"the encoder answered {len(states)} layers' states; it has {self.num_layers} "
                               "blocks and the embedding")
        return tuple(state.float() for state in states)
