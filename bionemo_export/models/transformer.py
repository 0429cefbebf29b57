"""The pre-LN transformer of Megatron/NeMo checkpoints (MegaMolBART, ESM-1nv, ProtT5nv), in plain
PyTorch.

Learned absolute positions (counted from 0), pre-LN layers (x + attention(LN(x)), x + mlp(LN(x))),
GELU MLPs (exact, or the tanh approximation that Megatron's fused bias-GELU computes), a final
LayerNorm per stack. Parameter names follow NeMo's (`input_layernorm`, `self_attention.dense`,
`inter_attention`, `mlp.dense_h_to_4h`, ...) with separate query/key/value projections: the
`.nemo` import splits Megatron's fused per-head projections into them (models/megatron.py).

`Encoder` is the encoder-only model (ESM-1nv, the encoder of ProtT5nv); MegaMolBART
(megamolbart.py) builds its encoder-decoder from the same layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bionemo_export.errors import InvalidInputError

ACTIVATIONS = ("gelu", "gelu_tanh")


@dataclass
class TransformerConfig:
    """The sizes and choices of one such transformer (defaults: MegaMolBART's released sizes)."""

    vocab_size: int
    hidden_size: int = 512
    num_layers: int = 6
    """Layers of the encoder (and of the decoder, unless num_decoder_layers says otherwise)."""
    num_heads: int = 8
    ffn_size: int = 0
    """Width of the MLPs; 0 means 4 * hidden_size."""
    max_position_embeddings: int = 512
    layer_norm_eps: float = 1e-5
    dropout: float = 0.0
    activation: str = "gelu"
    """gelu (exact, erf) or gelu_tanh (the tanh approximation)."""
    num_decoder_layers: int = 0
    """Layers of the decoder; 0 means num_layers."""

    def __post_init__(self) -> None:
        self.ffn_size = self.ffn_size or 4 * self.hidden_size
        self.num_decoder_layers = self.num_decoder_layers or self.num_layers
        if self.hidden_size % self.num_heads:
            raise InvalidInputError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.activation not in ACTIVATIONS:
            raise InvalidInputError(f"activation {self.activation!r} is not one of {ACTIVATIONS}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[batch, length, hidden] -> [batch, heads, length, head_dim]."""
    return x.unflatten(-1, (num_heads, -1)).transpose(1, 2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention; `allowed` (bool, broadcast to [batch, heads, queries, keys])
    is True where a query may look at a key. Returns [batch, queries, hidden]."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    # The dtype's minimum rather than -inf: exp() still gives exactly 0, and a fully masked row
    # (a padded query) gives a uniform average instead of NaN.
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return (scores.softmax(dim=-1) @ v).transpose(1, 2).flatten(2)


class Attention(nn.Module):
    """Multi-head attention with separate query/key/value projections and an output `dense`."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        hidden = config.hidden_size
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.dense = nn.Linear(hidden, hidden)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `x`, each [batch, heads, length, head_dim] (what caches hold)."""
        return _split_heads(self.key(x), self.num_heads), _split_heads(self.value(x), self.num_heads)

    def forward(
        self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """Attention of the queries of `x` over keys `k` and values `v` where `allowed`."""
        return self.dense(_attend(_split_heads(self.query(x), self.num_heads), k, v, allowed))


class Mlp(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.ffn_size)
        self.dense_4h_to_h = nn.Linear(config.ffn_size, config.hidden_size)
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(nn.functional.gelu(self.dense_h_to_4h(x), approximate=self.approximate))


class EncoderLayer(nn.Module):
    """Pre-LN: x + attention(LN(x)), then x + mlp(LN(x))."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attention = Attention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = Mlp(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + self.dropout(self.self_attention(h, *self.self_attention.keys_values(h), allowed))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class DecoderLayer(nn.Module):
    """Pre-LN: causal self-attention, cross-attention to the encoder (`inter_attention`), MLP."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attention = Attention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.inter_attention = Attention(config)
        self.post_inter_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = Mlp(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        self_allowed: torch.Tensor,
        cross: tuple[torch.Tensor, torch.Tensor],
        cross_allowed: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, keys, values): the keys/values of the cached positions followed by x's own."""
        h = self.input_layernorm(x)
        k, v = self.self_attention.keys_values(h)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        x = x + self.dropout(self.self_attention(h, k, v, self_allowed))
        x = x + self.dropout(self.inter_attention(self.post_attention_layernorm(x), *cross, cross_allowed))
        x = x + self.dropout(self.mlp(self.post_inter_attention_layernorm(x)))
        return x, k, v


class Embedding(nn.Module):
    """Token + learned absolute position embeddings; tokens start at position `offset`."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, ids: torch.Tensor, offset: int | torch.SymInt = 0) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device) + offset
        return self.dropout(self.word_embeddings(ids) + self.position_embeddings(positions))


class Stack(nn.Module):
    """The layers of the encoder or of the decoder, and their final LayerNorm."""

    def __init__(self, config: TransformerConfig, layer: type[nn.Module], count: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer(config) for _ in range(count))
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


def encode(embedding: Embedding, encoder: Stack, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Hidden states [batch, length, hidden] of `input_ids` where attention_mask marks real tokens."""
    allowed = attention_mask.bool()[:, None, None, :]
    x = embedding(input_ids)
    for layer in encoder.layers:
        x = layer(x, allowed)
    return encoder.final_layernorm(x)


def encode_layers(embedding: Embedding, encoder: Stack, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every layer's hidden states, in ESM's numbering (transformers' `output_hidden_states`): 0 the
    embedding's output, i the output of block i, the last after the stack's final LayerNorm (so it
    equals `encode`'s answer)."""
    allowed = attention_mask.bool()[:, None, None, :]
    x = embedding(input_ids)
    states = [x]
    for layer in encoder.layers:
        x = layer(x, allowed)
        states.append(x)
    states[-1] = encoder.final_layernorm(x)
    return tuple(states)


class Encoder(nn.Module):
    """An encoder-only model: forward(input_ids, attention_mask) -> hiddens [batch, length, hidden]."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.encoder = Stack(config, EncoderLayer, config.num_layers)
        self.apply(initialize)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return encode(self.embedding, self.encoder, input_ids, attention_mask)

    def layer_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every layer's hidden states (`encode_layers`): num_layers + 1 tensors [batch, length, hidden]."""
        return encode_layers(self.embedding, self.encoder, input_ids, attention_mask)


def initialize(module: nn.Module) -> None:
    """Megatron's initialisation (normal, std 0.02; zero biases), which these models were trained
    from; PyTorch's defaults would give the embeddings unit variance."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
