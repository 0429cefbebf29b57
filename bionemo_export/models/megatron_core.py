"""BioNeMo 2's ESM-2 (Megatron-core, read from a NeMo 2 directory: readers/nemo2.py) turned into
transformers' `EsmModel` names and settings.

The stored layout (keys after NeMo's `module.` prefix, which is stripped):

    embedding.word_embeddings.weight              [padded vocabulary, hidden]; rows past the 33 ESM
                                                  tokens are padding (to make_vocab_size_divisible_by)
    encoder.layers.<param>                        STACKED: one tensor per parameter, leading axis =
                                                  num_layers (Megatron's homogeneous-layer sharding);
                                                  `encoder.layers.<i>.<param>` when stored per layer
      self_attention.linear_qkv.layer_norm_{weight,bias}   the pre-attention LayerNorm (fused into
                                                           TransformerEngine's LayerNormLinear)
      self_attention.linear_qkv.{weight,bias}     fused QKV: for each query group g in turn, the rows
                                                  [q of g's heads; k_g; v_g] (head_dim rows per head);
                                                  ESM-2 has one group per head: [q_h; k_h; v_h]
      self_attention.linear_proj.{weight,bias}    attention output projection
      mlp.linear_fc1.layer_norm_{weight,bias}     the pre-MLP LayerNorm (fused into linear_fc1)
      mlp.linear_fc1.{weight,bias}, mlp.linear_fc2.{weight,bias}
      (input_layernorm.*, pre_mlp_layernorm.*: the same norms under Megatron's local layer spec)
    encoder.final_layernorm.{weight,bias}         EsmEncoder.emb_layer_norm_after
    lm_head.dense.*, lm_head.layer_norm.*         Megatron's BertLMHead: dense -> exact GELU -> LayerNorm
    output_layer.bias                             the LM head's bias, padded like the embeddings;
                                                  output_layer.weight only when untied
                                                  (share_embeddings_and_output_weights: false)

How it computes (context/model.yaml's `config:`; NeMo writes every field, defaults included):
- attention: ESM-2's layer specs divide the query by sqrt(head_dim) (bionemo's ESM2QueryScaling) with
  softmax_scale 1.0, before rotary embeddings (base 10000, rotate-half): EsmSelfAttention's math;
- MLP activation: `activation_func` torch's gelu with `bias_activation_fusion: true` (ESM2Config's
  defaults) runs Megatron's fused bias-GELU, the tanh approximation; without the fusion, or with
  bionemo's `esm_gelu_func`, exact (erf) GELU;
- embeddings: ESM-2's token dropout scaling (`token_dropout`), no position embeddings, no LayerNorm;
- every LayerNorm (and the head's) uses `layernorm_epsilon`.
Settings EsmModel cannot reproduce are refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from bionemo_export.models.base import leave_out
from bionemo_export.models.lm_head import HEAD_KEYS, OPTIONAL_HEAD_KEYS, HeadWeights
from bionemo_export.models.megatron import cut_vocab
from bionemo_export.models.readers import Checkpoint, CheckpointError
from bionemo_export.models.readers.nemo2 import CONTEXT, MODEL_YAML, model_config

MODULE_PREFIX = "module."
GELU_TARGETS = ("torch._C._nn.gelu", "torch.nn.functional.gelu", "gelu")
"""How context/model.yaml names torch's F.gelu (NeMo writes the builtin's own module, torch._C._nn)."""
EXACT_GELU = "esm_gelu_func"
"""bionemo-esm2's erf GELU (the default activation_func of its first releases)."""
REQUIRED_SETTINGS: dict[str, tuple[Any, ...]] = {
    "position_embedding_type": ("rope",),
    "normalization": ("LayerNorm",),
    "layernorm_zero_centered_gamma": (False,),
    "apply_residual_connection_post_layernorm": (False,),
    "gated_linear_unit": (False,),
    "add_bias_linear": (True,),
    "qk_layernorm": (False,),
    "rotary_interleaved": (False,),
    "rotary_percent": (1.0,),
    "rotary_base": (10000,),
    "seq_len_interpolation_factor": (None, 1.0),
    "softmax_scale": (None, 1.0),
}
"""config: settings EsmModel reproduces only with these values (the first is the default when a
key is absent). softmax_scale: the query is already divided by sqrt(head_dim) (None: bionemo
v2.0-v2.2's attention forced 1.0 itself)."""

LAYER_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "attention.LayerNorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "attention.LayerNorm.bias",
    "input_layernorm.weight": "attention.LayerNorm.weight",
    "input_layernorm.bias": "attention.LayerNorm.bias",
    "self_attention.linear_proj.weight": "attention.output.dense.weight",
    "self_attention.linear_proj.bias": "attention.output.dense.bias",
    "mlp.linear_fc1.layer_norm_weight": "LayerNorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "LayerNorm.bias",
    "pre_mlp_layernorm.weight": "LayerNorm.weight",
    "pre_mlp_layernorm.bias": "LayerNorm.bias",
    "mlp.linear_fc1.weight": "intermediate.dense.weight",
    "mlp.linear_fc1.bias": "intermediate.dense.bias",
    "mlp.linear_fc2.weight": "output.dense.weight",
    "mlp.linear_fc2.bias": "output.dense.bias",
}
"""A Megatron-core layer's parameters -> EsmLayer's (the fused QKV aside)."""
QKV = "self_attention.linear_qkv."
HEAD_NAMES = {"lm_head.dense.weight": "dense.weight", "lm_head.dense.bias": "dense.bias",
              "lm_head.layer_norm.weight": "layer_norm.weight", "lm_head.layer_norm.bias": "layer_norm.bias",
              "output_layer.bias": "bias", "output_layer.weight": "decoder.weight"}
"""The masked-LM head's keys -> lm_head.HEAD_KEYS (+ the optional untied decoder weight)."""
DROPPED = ("binary_head.", "pooler.")
"""Heads of Megatron's BERT that ESM-2 does not have (add_binary_head: false); ignored if present."""


@dataclass(frozen=True)
class Esm2Settings:
    """What context/model.yaml says about an ESM-2, checked to be what EsmModel computes."""

    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    layer_norm_eps: float
    activation: str
    """"gelu" (exact) or "gelu_tanh" (Megatron's fused bias-GELU), for the MLP; the head's is exact."""
    token_dropout: bool
    seq_length: int
    tied: bool
    """Output weights = the word embeddings (share_embeddings_and_output_weights)."""


def _source(checkpoint: Checkpoint) -> str:
    return str(checkpoint.path / CONTEXT / MODEL_YAML)


def _number(config: Mapping[str, Any], key: str, kind: type, source: str, default: Any = ...) -> Any:
    """config.<key> as an int or a float (> 0); CheckpointError naming it when absent or not one."""
    value = config.get(key, default)
    if kind is float and isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if value is ...:
        raise CheckpointError(f"{source}: config.{key} is missing; the model's size cannot be known without it")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)) \
            or value <= 0:
        raise CheckpointError(f"{source}: config.{key} is {value!r:.100}, expected a positive {kind.__name__}")
    return kind(value)


def _activation(config: Mapping[str, Any], source: str) -> str:
    """The MLP's activation, as Megatron-core's MLP runs `activation_func` (see the module docstring)."""
    value = config.get("activation_func")
    target = value.get("_target_") if isinstance(value, dict) else value
    fused = config.get("bias_activation_fusion", True)
    if target is None or target in GELU_TARGETS:
        return "gelu_tanh" if fused else "gelu"
    if isinstance(target, str) and target.rsplit(".", 1)[-1] == EXACT_GELU:
        return "gelu"
    raise CheckpointError(f"{source}: config.activation_func is {target!r:.100}; supported: torch's gelu (exact, or "
                          f"its tanh approximation with bias_activation_fusion) and bionemo's {EXACT_GELU}")


def _spec_option(value: Any) -> str | None:
    """biobert_spec_option's name when the YAML kept it (a string, or `_args_` of its enum)."""
    if isinstance(value, dict):
        args = value.get("_args_")
        value = args[0] if isinstance(args, list) and len(args) == 1 else None
    return value if isinstance(value, str) else None


def esm2_settings(checkpoint: Checkpoint) -> Esm2Settings:
    """The ESM-2 a NeMo 2 checkpoint's context/model.yaml describes; CheckpointError naming the
    setting EsmModel cannot reproduce."""
    config, source = model_config(checkpoint), _source(checkpoint)
    for key, allowed in REQUIRED_SETTINGS.items():
        value = config.get(key, allowed[0])
        if not any(value == ok and type(value) is not dict for ok in allowed):
            raise CheckpointError(f"{source}: config.{key} is {value!r:.100}; an ESM-2 is read only with "
                                  f"{' or '.join(map(repr, allowed))}")
    spec = _spec_option(config.get("biobert_spec_option"))
    if spec is not None and not spec.startswith("esm2_"):
        raise CheckpointError(f"{source}: config.biobert_spec_option is {spec!r}; only ESM-2's layer specs (esm2_*, "
                              "which scale the query by 1/sqrt(head size)) are read")
    hidden = _number(config, "hidden_size", int, source)
    heads = _number(config, "num_attention_heads", int, source)
    if hidden % heads:
        raise CheckpointError(f"{source}: config.hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    for key, expected in (("num_query_groups", heads), ("kv_channels", hidden // heads)):
        if config.get(key) is not None and config.get(key) != expected:
            raise CheckpointError(f"{source}: config.{key} is {config.get(key)!r:.100}; an ESM-2 is read only with "
                                  f"{expected} (or null)")
    return Esm2Settings(
        num_layers=_number(config, "num_layers", int, source),
        hidden_size=hidden,
        num_heads=heads,
        ffn_hidden_size=_number(config, "ffn_hidden_size", int, source, 4 * hidden),
        layer_norm_eps=_number(config, "layernorm_epsilon", float, source, 1e-5),
        activation=_activation(config, source),
        token_dropout=bool(config.get("token_dropout", True)),
        seq_length=_number(config, "seq_length", int, source, 1024),
        tied=bool(config.get("share_embeddings_and_output_weights", True)),
    )


# ------------------------------------------------------------------------------------ weights
def unstack_layers(weights: Mapping[str, torch.Tensor], num_layers: int, source: str) -> dict[str, torch.Tensor]:
    """`encoder.layers.<param>` tensors (leading axis = layer) split into `encoder.layers.<i>.<param>`;
    keys already per layer are kept."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in weights.items():
        rest = key.removeprefix("encoder.layers.")
        if rest == key or re.match(r"\d+\.", rest):
            out[key] = tensor
            continue
        if tensor.dim() == 0 or tensor.shape[0] != num_layers:
            raise CheckpointError(f"{source}: {MODULE_PREFIX}{key} has shape {tuple(tensor.shape)}, but a stacked "
                                  f"per-layer tensor leads with config.num_layers ({num_layers})")
        for i in range(num_layers):
            out[f"encoder.layers.{i}.{rest}"] = tensor[i]
    return out


def split_qkv(tensor: torch.Tensor, heads: int, groups: int, key: str, source: str) -> tuple[torch.Tensor, ...]:
    """(query, key, value) of a fused `linear_qkv` weight or bias, laid out as Megatron-core's
    SelfAttention splits it: per query group, [q of its heads; k; v]; heads concatenated in order."""
    per_group = heads // groups + 2
    if tensor.dim() == 0 or tensor.shape[0] % (groups * per_group):
        raise CheckpointError(f"{source}: {key} has shape {tuple(tensor.shape)}, not {groups} query groups of "
                              f"{per_group} heads' rows")
    head_dim = tensor.shape[0] // (groups * per_group)
    blocks = tensor.reshape(groups, per_group, head_dim, *tensor.shape[1:])
    query = blocks[:, : per_group - 2].reshape(heads * head_dim, *tensor.shape[1:])
    key_rows = blocks[:, per_group - 2].reshape(groups * head_dim, *tensor.shape[1:])
    value = blocks[:, per_group - 1].reshape(groups * head_dim, *tensor.shape[1:])
    return query.contiguous(), key_rows.contiguous(), value.contiguous()


def _check_rotary(inv_freq: torch.Tensor | None, head_dim: int, source: str) -> None:
    """A stored rotary frequency table (Megatron does not store one) must be EsmModel's."""
    if inv_freq is None:
        return
    expected = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if inv_freq.shape != expected.shape or not torch.allclose(inv_freq.float(), expected, rtol=1e-4):
        raise CheckpointError(f"{source}: {MODULE_PREFIX}rotary_pos_emb.inv_freq is not the standard rotary "
                              f"frequency table for head size {head_dim}")


def _take_head(weights: dict[str, torch.Tensor], settings: Esm2Settings, vocab_size: int, source: str
               ) -> HeadWeights | None:
    """The masked-LM head's weights, taken out of `weights`; None when the checkpoint has none."""
    found = {name: key for key, name in HEAD_NAMES.items() if key in weights}
    if not found:
        return None
    head = {name: weights.pop(key) for name, key in found.items()}
    if "decoder.weight" in head:  # padded like the embeddings
        head["decoder.weight"] = cut_vocab(head["decoder.weight"], vocab_size, MODULE_PREFIX + "output_layer.weight",
                                           source)
    elif not settings.tied:
        raise CheckpointError(f"{source}: share_embeddings_and_output_weights is false but "
                              f"{MODULE_PREFIX}output_layer.weight is missing")
    inverse = {name: key for key, name in HEAD_NAMES.items()}
    names = {name: MODULE_PREFIX + inverse[name] for name in HEAD_KEYS + OPTIONAL_HEAD_KEYS}
    return HeadWeights(head, names, activation="gelu", layer_norm_eps=settings.layer_norm_eps, tied=settings.tied)


def esm2_weights(checkpoint: Checkpoint, settings: Esm2Settings, vocab_size: int
                 ) -> tuple[dict[str, torch.Tensor], HeadWeights | None]:
    """(EsmModel's state dict, the masked-LM head or None) of a NeMo 2 ESM-2's weights. Keys that
    match nothing keep their Megatron names, so that the strict load names them as unexpected."""
    source = checkpoint.weights_path
    weights = {key.removeprefix(MODULE_PREFIX): tensor for key, tensor in checkpoint.weights.items()}
    head = _take_head(weights, settings, vocab_size, source)
    inv_freq = weights.pop("rotary_pos_emb.inv_freq", None)
    _check_rotary(inv_freq, settings.hidden_size // settings.num_heads, source)
    if inv_freq is not None:
        leave_out(MODULE_PREFIX + "rotary_pos_emb.inv_freq", "the rotary table: checked, and computed from the config")
    weights = unstack_layers(weights, settings.num_layers, source)
    out: dict[str, torch.Tensor] = {}

    def put(name: str, tensor: torch.Tensor, key: str) -> None:
        if name in out:
            raise CheckpointError(f"{source}: {MODULE_PREFIX}{key} is a second copy of {name}")
        out[name] = tensor

    for key, tensor in weights.items():
        if key.startswith(DROPPED):
            leave_out(MODULE_PREFIX + key, f"{key.split('.')[0]}: a head of Megatron's BERT that ESM-2 does not serve")
            continue
        layer = re.match(r"encoder\.layers\.(\d+)\.(.*)", key)
        if layer is None:
            name = {"embedding.word_embeddings.weight": "embeddings.word_embeddings.weight",
                    "encoder.final_layernorm.weight": "encoder.emb_layer_norm_after.weight",
                    "encoder.final_layernorm.bias": "encoder.emb_layer_norm_after.bias"}.get(key, key)
            if name == "embeddings.word_embeddings.weight":
                tensor = cut_vocab(tensor, vocab_size, MODULE_PREFIX + key, source)
            put(name, tensor, key)
            continue
        index, rest = layer.groups()
        prefix = f"encoder.layer.{index}."
        if rest.startswith(QKV) and rest[len(QKV):] in ("weight", "bias"):
            leaf = rest[len(QKV):]
            parts = split_qkv(tensor, settings.num_heads, settings.num_heads, MODULE_PREFIX + key, source)
            for part, value in zip(("query", "key", "value"), parts):
                put(f"{prefix}attention.self.{part}.{leaf}", value, key)
        elif rest in LAYER_NAMES:
            put(prefix + LAYER_NAMES[rest], tensor, key)
        else:
            put(key, tensor, key)
    return out, head
