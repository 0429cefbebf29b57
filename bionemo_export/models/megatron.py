"""Megatron's weight layouts and settings, as found in BioNeMo `.nemo` checkpoints, turned into
plain ones (the names of transformer.py's modules, or a family's own).

- Fused attention projections: `query_key_value` [3 * hidden, hidden] holds, for each head h in
  turn, the rows [q_h, k_h, v_h] (head_dim rows each); the cross-attention `key_value` holds
  [k_h, v_h] per head; biases alike. `split_fused` turns them into separate `query`, `key` and
  `value` projections (per-head order kept, heads concatenated as usual).
- Vocabulary padding: embedding and output rows are padded to a multiple of
  `make_vocab_size_divisible_by` (128); `cut_vocab` keeps the tokenizer's rows only, so nothing
  downstream (a softmax, an argmax) ever sees a padded id.
- `rename` maps key prefixes (the checkpoint's module paths to the family's);
  `encoder_decoder_keys` (MegaMolBART, ProtT5nv) and `bert_encoder_keys` (ESM-1nv) apply all of it.
- `transformer_config` reads model_config.yaml (flat, or nested encoder:/decoder: sections) into a
  TransformerConfig, refusing settings the pre-LN transformer does not implement, by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from bionemo_export.models.base import leave_out
from bionemo_export.models.readers import Checkpoint, CheckpointError
from bionemo_export.models.readers.megatron_ranks import FUSED

if TYPE_CHECKING:
    from bionemo_export.models.lm_head import HeadWeights



def split_fused(weights: Mapping[str, torch.Tensor], num_heads: int, source: str) -> dict[str, torch.Tensor]:
    """`weights` with every fused `query_key_value` / `key_value` weight and bias split per head."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in weights.items():
        module, _, leaf = key.rpartition(".")
        parent, _, name = module.rpartition(".")
        parts = FUSED.get(name)
        if parts is None or leaf not in ("weight", "bias"):
            out[key] = tensor
            continue
        rows = tensor.shape[0]
        if rows % (len(parts) * num_heads):
            raise CheckpointError(f"{source}: {key} has {rows} rows, not a multiple of {len(parts)} x "
                                  f"{num_heads} heads")
        # (heads, parts, head_dim, ...) -> part p of every head, heads in order
        per_head = tensor.reshape(num_heads, len(parts), rows // (len(parts) * num_heads), *tensor.shape[1:])
        for index, part in enumerate(parts):
            split = per_head[:, index].reshape(rows // len(parts), *tensor.shape[1:])
            out[f"{parent}.{part}.{leaf}" if parent else f"{part}.{leaf}"] = split.contiguous()
    return out


def cut_vocab(tensor: torch.Tensor, size: int, key: str, source: str) -> torch.Tensor:
    """The first `size` rows of a vocabulary-padded tensor (embedding, output weight or bias)."""
    if tensor.shape[0] < size:
        raise CheckpointError(f"{source}: {key} has {tensor.shape[0]} rows but the tokenizer has {size} tokens")
    return tensor[:size].contiguous()


def rename(weights: Mapping[str, torch.Tensor], prefixes: Iterable[tuple[str, str]],
           drop: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Keys starting with a source prefix get the destination prefix instead (first match wins);
    keys starting with a `drop` prefix are left out; any other key is kept as it is (and so is
    reported as unexpected by the strict load)."""
    table = list(prefixes)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in weights.items():
        if key.startswith(drop):
            leave_out(key, f"{key.split('.')[0]}: not served (a head or pooler the served model does not use)")
            continue
        for old, new in table:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = tensor
    return out


MEGATRON_HEAD_RENAMES = {"layernorm.weight": "layer_norm.weight", "layernorm.bias": "layer_norm.bias"}
"""NeMo BertLMHead's names (after `lm_head.`) -> lm_head.HEAD_KEYS (`dense.*` and `bias` agree)."""


def megatron_lm_head(weights: Mapping[str, torch.Tensor], checkpoint: Checkpoint
                     ) -> tuple[dict[str, torch.Tensor], HeadWeights | None]:
    """(the other weights, the masked-LM head or None) of a NeMo Megatron BERT (ESM-2nv, ESM-1nv)
    state dict without its `model.` prefix: `lm_head.dense`, `lm_head.layernorm`, `lm_head.bias`
    (vocabulary-padded), output weights shared with the word embeddings. NeMo's BertLMHead applies
    exact GELU (the tanh approximation with `openai_gelu: true`) and the model's layernorm_epsilon."""
    from bionemo_export.models.lm_head import HeadWeights, split_head
    from bionemo_export.models.readers.nemo import setting

    rest, head, names = split_head(weights, "lm_head.", MEGATRON_HEAD_RENAMES, checkpoint.weights_path)
    if not head:
        return rest, None
    activation = "gelu_tanh" if bool(setting(checkpoint, "openai_gelu", default=False)) else "gelu"
    eps = float(setting(checkpoint, "layernorm_epsilon", default=1e-5))
    return rest, HeadWeights(head, names, activation=activation, layer_norm_eps=eps, tied=True)


def check_gelu(activation: str, bias_gelu_fusion: bool, source: str) -> str:
    """The TransformerConfig activation for Megatron settings: its fused bias-GELU computes the
    tanh approximation; the unfused path exact GELU. Other activations are not supported."""
    if activation not in ("gelu",):
        raise CheckpointError(f"{source}: activation {activation!r} is not supported (only gelu)")
    return "gelu_tanh" if bias_gelu_fusion else "gelu"


def fused_bias_gelu(checkpoint, section: str | None = None, encoder_decoder: bool = False) -> bool:
    """Whether NeMo runs a stack's MLP through Megatron's fused bias-GELU (the tanh approximation),
    with NeMo's own precedence (docs/reference/checkpoint-layouts.md, "GELU"):
    - Megatron BERT (ESM-1nv, ESM-2nv) reads `bias_gelu_fusion`, default true;
    - encoder-decoder models (MegaMolBART, ProtT5nv) read `bias_activation_fusion`: from a nested
      encoder:/decoder: section as it is (default true); in a flat config, the deprecated alias
      `bias_gelu_fusion` wins when present, then `bias_activation_fusion`, then `bias` (the oldest
      configs had neither key, and fusion followed the bias)."""
    config = checkpoint.config
    if not encoder_decoder:
        return bool(config.get("bias_gelu_fusion", True))
    nested = config.get(section) if section else None
    if isinstance(nested, dict):
        return bool(nested.get("bias_activation_fusion", True))
    for key in ("bias_gelu_fusion", "bias_activation_fusion", "bias"):
        if key in config:
            return bool(config[key])
    return True


def strip_model_prefix(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys without NeMo's leading `model.` (present in some archives, absent in others)."""
    return {key.removeprefix("model."): tensor for key, tensor in weights.items()}


def encoder_decoder_keys(weights: Mapping[str, torch.Tensor], num_heads: int, source: str) -> dict[str, torch.Tensor]:
    """A NeMo Megatron encoder-decoder (MegaMolBART, ProtT5nv) under the names of
    transformer.py's modules: `embedding.*`, `encoder.*`, `decoder.*`, `tokens_head.*`.

    The decoder shares the encoder's token and position embeddings: a `decoder_embedding` that
    repeats them is dropped, one that differs is refused."""
    weights = split_fused(strip_model_prefix(weights), num_heads, source)
    for leaf in ("word_embeddings.weight", "position_embeddings.weight"):
        shared = weights.get(f"enc_dec_model.encoder_embedding.{leaf}")
        own = weights.pop(f"enc_dec_model.decoder_embedding.{leaf}", None)
        if own is not None and (shared is None or not torch.equal(own, shared)):
            raise CheckpointError(f"{source}: enc_dec_model.decoder_embedding.{leaf} differs from the encoder's; "
                                  "separate decoder embeddings are not supported")
        if own is not None:
            leave_out(f"enc_dec_model.decoder_embedding.{leaf}", "a copy of the shared encoder embeddings")
    return rename(weights, [
        ("enc_dec_model.encoder_embedding.", "embedding."),
        ("enc_dec_model.enc_dec_model.encoder.model.", "encoder."),
        ("enc_dec_model.enc_dec_model.decoder.model.", "decoder."),
        ("enc_dec_model.tokens_head.", "tokens_head."),
    ])


def bert_encoder_keys(weights: Mapping[str, torch.Tensor], num_heads: int, source: str) -> dict[str, torch.Tensor]:
    """A NeMo Megatron BERT (ESM-1nv) under the names of transformer.py's `Encoder`; the LM,
    binary and pooler heads left out. Token-type embeddings (every token has type 0) are folded
    into the position embeddings, which they are added to."""
    weights = split_fused(strip_model_prefix(weights), num_heads, source)
    tokentype = weights.pop("language_model.embedding.tokentype_embeddings.weight", None)
    positions = "language_model.embedding.position_embeddings.weight"
    if tokentype is not None and positions in weights:
        weights[positions] = weights[positions] + tokentype[0]
    return rename(weights, [
        ("language_model.embedding.", "embedding."),
        ("language_model.encoder.", "encoder."),
    ], drop=("lm_head.", "binary_head.", "language_model.pooler."))


def check_megatron_block(checkpoint, section: str | None = None) -> None:
    """Refuse Megatron settings the pre-LN transformer here does not implement, naming the key."""
    from bionemo_export.models.readers.nemo import setting

    source = f"{checkpoint.path}:model_config.yaml"
    expected = {"position_embedding_type": ("learned_absolute",), "normalization": ("layernorm",),
                "transformer_block_type": ("pre_ln",), "apply_residual_connection_post_layernorm": (False,),
                "bias": (True,), "headscale": (False,)}
    for key, allowed in expected.items():
        value = setting(checkpoint, key, section, default=allowed[0])
        if value not in allowed:
            where = f"{section}.{key}" if section else key
            raise CheckpointError(f"{source}: {where} is {value!r}; supported: {', '.join(map(repr, allowed))}")
    hidden = int(setting(checkpoint, "hidden_size", section))
    heads = int(setting(checkpoint, "num_attention_heads", section))
    kv_channels = setting(checkpoint, "kv_channels", section, default=None)
    if kv_channels is not None and int(kv_channels) * heads != hidden:
        raise CheckpointError(f"{source}: kv_channels {kv_channels} x {heads} heads != hidden_size {hidden}; "
                              "not supported")


def transformer_config(checkpoint, vocab_size: int, sections: tuple[str | None, ...] = (None,)):
    """The TransformerConfig a .nemo's model_config.yaml describes. With `sections`
    ("encoder", "decoder") (an encoder-decoder model), nested per-stack settings are read and must
    agree on everything but the number of layers; (None,) is a Megatron BERT."""
    from bionemo_export.models.readers.nemo import setting
    from bionemo_export.models.transformer import TransformerConfig

    source = f"{checkpoint.path}:model_config.yaml"
    encoder_decoder = "encoder" in sections
    stacks = []
    for section in sections:
        check_megatron_block(checkpoint, section)
        hidden = int(setting(checkpoint, "hidden_size", section))
        stacks.append({
            "hidden_size": hidden,
            "num_heads": int(setting(checkpoint, "num_attention_heads", section)),
            "ffn_size": int(setting(checkpoint, "ffn_hidden_size", section, default=4 * hidden)),
            "layer_norm_eps": float(setting(checkpoint, "layernorm_epsilon", section, default=1e-5)),
            "activation": check_gelu(setting(checkpoint, "activation", section, default="gelu"),
                                     fused_bias_gelu(checkpoint, section, encoder_decoder), source),
            "max_position_embeddings": int(setting(checkpoint, "max_position_embeddings", section)),
            "num_layers": int(setting(checkpoint, "num_layers", section)),
        })
    first = stacks[0]
    for name, other in zip(sections[1:], stacks[1:]):
        differing = sorted(k for k in first if k != "num_layers" and first[k] != other[k])
        if differing:
            raise CheckpointError(f"{source}: the {name} differs from the {sections[0]} in {', '.join(differing)}; "
                                  "only the number of layers may differ")
    decoder_layers = stacks[-1]["num_layers"] if len(stacks) > 1 else 0
    return TransformerConfig(vocab_size=vocab_size, num_decoder_layers=decoder_layers, **first)
