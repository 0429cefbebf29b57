"""NVIDIA's TransformerEngine ESM-2 (`nv_esm`, bionemo-recipes `models/esm2`) read into the names
of transformers' `EsmModel`, from its config.json and weights only (its own modeling code, named
by config.json's `auto_map`, is never imported or run).

The layout, as NVIDIA's `convert.py` writes it and `modeling_esm_te.py` reads it
(NVIDIA/bionemo-framework, bionemo-recipes/models/esm2; docs/reference/checkpoint-layouts.md):

    P = "model."  exports since 2026-03-20 (commit f437be05e, base_model_prefix "model")
        "esm."    2025 exports
        ""        an NVEsmModel saved on its own
    P embeddings.word_embeddings.weight        [padded_vocab_size, H]; rows past the 33 ESM
                                               tokens are zeros (cut here)
    P embeddings.layer_norm.{weight,bias}      only with emb_layer_norm_before
    P encoder.layers.{i}.self_attention.layernorm_qkv.layer_norm_{weight,bias}
                                               the pre-attention norm (attention.LayerNorm)
    P encoder.layers.{i}.self_attention.layernorm_qkv.{weight,bias}
                                               fused QKV [3H, H] / [3H]: with
                                               qkv_weight_interleaved (the default) the rows are,
                                               head after head, [q_h; k_h; v_h] (head_dim rows
                                               each); without it [all q; all k; all v]. With
                                               fuse_qkv_params false: separate
                                               layernorm_qkv.{query,key,value}_{weight,bias}
    P encoder.layers.{i}.self_attention.proj.{weight,bias}        attention.output.dense
    P encoder.layers.{i}.layernorm_mlp.layer_norm_{weight,bias}   the pre-MLP norm (LayerNorm)
    P encoder.layers.{i}.layernorm_mlp.fc1_{weight,bias}          intermediate.dense
    P encoder.layers.{i}.layernorm_mlp.fc2_{weight,bias}          output.dense
    P encoder.emb_layer_norm_after.{weight,bias}
    P encoder.rotary_embeddings.inv_freq       exports before 2026-03-20: checked to be the
                                               standard table, left out (EsmModel computes it)
    P pooler.dense.{weight,bias}               an NVEsmModel with a pooler: no task uses it, left out
    lm_head.dense.{weight,bias}                NVEsmForMaskedLM's head: dense -> exact GELU ->
    lm_head.decoder.layer_norm_{weight,bias}   the head's layer norm, fused into the decoder
    lm_head.decoder.bias                       [padded_vocab_size]; padding = the dtype's minimum
    lm_head.decoder.weight                     tied to the word embeddings (usually not stored)
    classifier.{weight,bias}                   NVEsmForTokenClassification's per-token Linear
    *._extra_state                             TransformerEngine metadata, skipped by the reader

Exports before 2025-09-18 have no `padded_vocab_size` (33 rows); the exports since 2026-03-20
write padded_vocab_size = vocab_size (no padding at all). Either is read.

What NVIDIA's model computes, reproduced here: TransformerEngine's "gelu" activation in the
encoder's MLP is the tanh approximation (TransformerEngine common/util/math.h, and the torch
reference in layernorm_mlp.py), not the exact GELU of transformers' EsmModel, so the encoder is
built with `gelu_approximate = "tanh"`; the masked-LM head applies torch's exact GELU.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

from bionemo_export.models.base import leave_out
from bionemo_export.models.classifier import ClassifierWeights, classifier_kind, config_labels
from bionemo_export.models.lm_head import HeadWeights
from bionemo_export.models.readers import Checkpoint, CheckpointError
from bionemo_export.models.readers.base import some

PREFIXES = ("model.", "esm.", "")
"""Where the backbone's keys start: newest exports first."""
FUSED_LAYOUTS = {"interleaved": "per head [q_h; k_h; v_h]", "concatenated": "[all q; all k; all v]",
                 "separate": "separate query/key/value weights"}
LAYER_RENAMES = {
    "self_attention.layernorm_qkv.layer_norm_weight": "attention.LayerNorm.weight",
    "self_attention.layernorm_qkv.layer_norm_bias": "attention.LayerNorm.bias",
    "self_attention.proj.weight": "attention.output.dense.weight",
    "self_attention.proj.bias": "attention.output.dense.bias",
    "layernorm_mlp.layer_norm_weight": "LayerNorm.weight",
    "layernorm_mlp.layer_norm_bias": "LayerNorm.bias",
    "layernorm_mlp.fc1_weight": "intermediate.dense.weight",
    "layernorm_mlp.fc1_bias": "intermediate.dense.bias",
    "layernorm_mlp.fc2_weight": "output.dense.weight",
    "layernorm_mlp.fc2_bias": "output.dense.bias",
}
"""One TransformerEngine layer's keys (after `encoder.layers.{i}.`) -> EsmLayer's (after `encoder.layer.{i}.`)."""
TOP_RENAMES = {
    "embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight",
    "embeddings.layer_norm.weight": "embeddings.layer_norm.weight",
    "embeddings.layer_norm.bias": "embeddings.layer_norm.bias",
    "encoder.emb_layer_norm_after.weight": "encoder.emb_layer_norm_after.weight",
    "encoder.emb_layer_norm_after.bias": "encoder.emb_layer_norm_after.bias",
}
HEAD_RENAMES = {
    "lm_head.dense.weight": "dense.weight",
    "lm_head.dense.bias": "dense.bias",
    "lm_head.decoder.layer_norm_weight": "layer_norm.weight",
    "lm_head.decoder.layer_norm_bias": "layer_norm.bias",
    "lm_head.decoder.bias": "bias",
    "lm_head.decoder.weight": "decoder.weight",
}
"""NVEsmLMHead's keys -> lm_head.HEAD_KEYS names."""
CLASSIFIER_RENAMES = {"classifier.weight": "out.weight", "classifier.bias": "out.bias"}
FLOAT8 = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
               if hasattr(torch, name))


@dataclass
class NvEsmWeights:
    """An nv_esm checkpoint's weights under EsmModel's names, and its heads."""

    backbone: dict[str, torch.Tensor]
    head: HeadWeights | None
    classifier: ClassifierWeights | None
    facts: dict[str, Any] = field(default_factory=dict)
    """For manifest.json: the key prefix, the QKV layout, the padded vocabulary, the MLP activation."""


REQUIRED: Any = object()
"""`_setting`'s default for keys config.json must have."""


def _setting(config: Mapping[str, Any], key: str, source: str, kind: type, default: Any = REQUIRED) -> Any:
    """config.json's `key` as `kind` (int, float, bool, str); `default` when absent or null,
    CheckpointError naming the key when it is required or of another type."""
    value = config.get(key)
    if value is None:
        if default is REQUIRED:
            raise CheckpointError(f"{source} has no {key}: NVIDIA's ESM-2 config.json always sets it; "
                                  "re-export the checkpoint or add it")
        return default
    valid = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, valid = float(value), True
    if not valid:
        raise CheckpointError(f"{source}: {key} is {value!r}, expected a {kind.__name__}")
    return value


def _refuse(source: str, key: str, value: Any, supported: str) -> CheckpointError:
    return CheckpointError(f"{source}: {key} is {value!r}; this tool computes only {supported} "
                           f"(EsmModel's architecture), so this checkpoint cannot be exported")


def nv_esm_config(checkpoint: Checkpoint, alphabet: Sequence[str]) -> transformers.EsmConfig:
    """config.json -> the EsmConfig of the same network (vocabulary cut to `alphabet`, dropout
    off, `gelu_approximate = "tanh"` for TransformerEngine's GELU). Settings it cannot compute
    are refused, naming the key."""
    raw, source = checkpoint.config, str(checkpoint.path / "config.json")
    hidden = _setting(raw, "hidden_size", source, int)
    heads = _setting(raw, "num_attention_heads", source, int)
    sizes = {"hidden_size": hidden, "num_attention_heads": heads,
             "num_hidden_layers": _setting(raw, "num_hidden_layers", source, int),
             "intermediate_size": _setting(raw, "intermediate_size", source, int)}
    if bad := [f"{key} {value}" for key, value in sizes.items() if value < 1]:
        raise CheckpointError(f"{source}: {', '.join(bad)}: sizes must be positive")
    if hidden % heads:
        raise CheckpointError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    # What NVEsmConfig / EsmConfig default to when a key is absent.
    for key, default, supported in (("position_embedding_type", "absolute", "rotary"),
                                    ("encoder_activation", "gelu", "gelu"),
                                    ("attn_mask_type", "padding", "padding")):
        value = _setting(raw, key, source, str, default)
        if value != supported:
            raise _refuse(source, key, value, repr(supported))
    if _setting(raw, "is_folding_model", source, bool, False):
        raise _refuse(source, "is_folding_model", True, "the language model (ESMFold is not read)")
    vocab = _setting(raw, "vocab_size", source, int)
    if vocab != len(alphabet):
        raise CheckpointError(f"{source}: vocab_size is {vocab}; ESM-2's alphabet has {len(alphabet)} tokens "
                              "and only that vocabulary is supported")
    padded = _setting(raw, "padded_vocab_size", source, int, vocab)
    if padded < vocab:
        raise CheckpointError(f"{source}: padded_vocab_size {padded} is smaller than vocab_size {vocab}")
    ids = {"pad_token_id": alphabet.index("<pad>"), "mask_token_id": alphabet.index("<mask>")}
    for key, expected in ids.items():
        value = _setting(raw, key, source, int, expected)
        if value != expected:
            raise CheckpointError(f"{source}: {key} is {value}; the ESM-2 alphabet has it at {expected}")
    config = transformers.EsmConfig(
        vocab_size=vocab, **ids, **sizes,
        position_embedding_type="rotary",
        max_position_embeddings=_setting(raw, "max_position_embeddings", source, int, 1026),
        layer_norm_eps=_setting(raw, "layer_norm_eps", source, float, 1e-12),
        token_dropout=_setting(raw, "token_dropout", source, bool, False),
        emb_layer_norm_before=_setting(raw, "emb_layer_norm_before", source, bool, False),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config.gelu_approximate = "tanh"  # TransformerEngine's "gelu" (Esm2Family.make_backbone)
    return config


def qkv_layout(raw: Mapping[str, Any], source: str) -> str:
    """"interleaved", "concatenated" or "separate": how config.json says the QKV weights are stored
    (TransformerEngine ignores qkv_weight_interleaved when fuse_qkv_params is false)."""
    if not _setting(raw, "fuse_qkv_params", source, bool, True):
        return "separate"
    return "interleaved" if _setting(raw, "qkv_weight_interleaved", source, bool, True) else "concatenated"


def find_prefix(weights: Mapping[str, torch.Tensor], source: str) -> str:
    """The backbone's key prefix: the one under which the word embeddings are stored."""
    for prefix in PREFIXES:
        if f"{prefix}embeddings.word_embeddings.weight" in weights:
            return prefix
    raise CheckpointError(f"{source} has no word embeddings: expected model.embeddings.word_embeddings.weight "
                          "(exports since 2026-03-20), esm.embeddings.word_embeddings.weight (2025 exports) or "
                          "embeddings.word_embeddings.weight (an NVEsmModel); is this an nv_esm checkpoint?")


def expected_shapes(config: transformers.EsmConfig, prefix: str, layout: str, padded: int
                    ) -> dict[str, tuple[int, ...]]:
    """Every backbone key an NVEsmModel of `config` stores, with its shape."""
    hidden, ffn = config.hidden_size, config.intermediate_size
    shapes = {f"{prefix}embeddings.word_embeddings.weight": (padded, hidden),
              f"{prefix}encoder.emb_layer_norm_after.weight": (hidden,),
              f"{prefix}encoder.emb_layer_norm_after.bias": (hidden,)}
    if config.emb_layer_norm_before:
        shapes |= {f"{prefix}embeddings.layer_norm.weight": (hidden,), f"{prefix}embeddings.layer_norm.bias": (hidden,)}
    layer_shapes = {key: (hidden,) for key in LAYER_RENAMES}  # norms and biases
    layer_shapes |= {"self_attention.proj.weight": (hidden, hidden), "layernorm_mlp.fc1_weight": (ffn, hidden),
                     "layernorm_mlp.fc1_bias": (ffn,), "layernorm_mlp.fc2_weight": (hidden, ffn)}
    if layout == "separate":
        qkv = {f"self_attention.layernorm_qkv.{part}_{leaf}": shape for part in ("query", "key", "value")
               for leaf, shape in (("weight", (hidden, hidden)), ("bias", (hidden,)))}
    else:
        qkv = {"self_attention.layernorm_qkv.weight": (3 * hidden, hidden),
               "self_attention.layernorm_qkv.bias": (3 * hidden,)}
    for i in range(config.num_hidden_layers):
        layer = f"{prefix}encoder.layers.{i}."
        shapes |= {layer + key: shape for key, shape in (qkv | layer_shapes).items()}
    return shapes


def _check_keys(weights: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]],
                optional: Mapping[str, tuple[int, ...]], source: str) -> None:
    """Every expected key present with its shape, optional ones with theirs, nothing else."""
    problems = []
    if missing := [key for key in expected if key not in weights]:
        problems.append(f"missing keys: {some(missing)}")
    if unexpected := sorted(key for key in weights if key not in expected and key not in optional):
        problems.append(f"unexpected keys: {some(unexpected)}")
    shapes = {**optional, **expected}
    if wrong := [f"{key} is {tuple(weights[key].shape)}, expected {shapes[key]}" for key in shapes
                 if key in weights and tuple(weights[key].shape) != shapes[key]]:
        problems.append(f"wrong shapes: {some(wrong)}")
    if problems:
        raise CheckpointError(f"{source} does not match the NVIDIA TransformerEngine ESM-2 that config.json describes: "
                              + "; ".join(problems) + ". Fix config.json's sizes or re-export the checkpoint")


def _split_qkv(tensor: torch.Tensor, layout: str, heads: int) -> tuple[torch.Tensor, ...]:
    """(query, key, value) of a fused [3H, ...] QKV weight or bias stored in `layout`."""
    rest = tensor.shape[1:]
    if layout == "interleaved":
        per_head = tensor.reshape(heads, 3, tensor.shape[0] // (3 * heads), *rest)
        return tuple(per_head[:, part].reshape(-1, *rest).contiguous() for part in range(3))
    return tuple(part.contiguous() for part in tensor.reshape(3, -1, *rest))


def _check_rotary(inv_freq: torch.Tensor, config: transformers.EsmConfig, key: str, source: str) -> None:
    """A stored rotary table must be the standard one (base 10000) that EsmModel computes."""
    head_dim = config.hidden_size // config.num_attention_heads
    standard = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    # a bfloat16 export converts the buffer too: equal within its precision
    rtol = max(1e-4, torch.finfo(inv_freq.dtype).eps) if inv_freq.is_floating_point() else 1e-4
    if not torch.allclose(inv_freq.float(), standard, rtol=rtol):
        raise CheckpointError(f"{source}: {key} is not the standard rotary frequency table (base 10000) for "
                              f"head size {head_dim}; other rotary settings are not supported")


def nv_esm_weights(checkpoint: Checkpoint, config: transformers.EsmConfig) -> NvEsmWeights:
    """The checkpoint's weights under EsmModel's names (strictly checked against the layout
    above), its masked-LM head (HeadWeights) and its token classifier, if any."""
    raw, source = checkpoint.config, checkpoint.weights_path
    weights = dict(checkpoint.weights)
    if quantized := [key for key, tensor in weights.items() if tensor.dtype in FLOAT8]:
        raise CheckpointError(f"{source}: {some(quantized)} are stored in float8 (their scales are in "
                              "TransformerEngine's _extra_state, which is not read); export the checkpoint in "
                              "float32 or bfloat16")
    layout = qkv_layout(raw, str(checkpoint.path / "config.json"))
    prefix = find_prefix(weights, source)
    padded = raw.get("padded_vocab_size") or config.vocab_size
    assert padded is not None  # nv_esm_config set the config's vocab_size
    classifier_keys = {key: weights.pop(key) for key in list(weights) if key.startswith("classifier.")}
    _check_keys(weights, *_layout_shapes(weights, config, prefix, layout, padded), source)
    inv_freq = f"{prefix}encoder.rotary_embeddings.inv_freq"
    if inv_freq in weights:
        _check_rotary(weights[inv_freq], config, inv_freq, source)
        leave_out(inv_freq, "the rotary frequency table: EsmModel computes the same one from the config")
    for key in weights:
        if key.startswith(f"{prefix}pooler."):
            leave_out(key, "pooler: no served task uses it")
    facts = {"activation": "gelu_tanh", "key_prefix": prefix or "(none)", "qkv_layout": FUSED_LAYOUTS[layout],
             "padded_vocab_size": padded}
    return NvEsmWeights(_backbone(weights, config, prefix, layout), _head(weights, config, raw),
                        _classifier(checkpoint, classifier_keys), facts)


def _layout_shapes(weights: Mapping[str, torch.Tensor], config: transformers.EsmConfig, prefix: str, layout: str,
                   padded: int) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(required, optional) keys with their shapes: the backbone's, and the masked-LM head's
    when the file has any `lm_head.` key."""
    hidden = config.hidden_size
    expected = expected_shapes(config, prefix, layout, padded)
    optional = {f"{prefix}encoder.rotary_embeddings.inv_freq": (hidden // config.num_attention_heads // 2,),
                f"{prefix}pooler.dense.weight": (hidden, hidden), f"{prefix}pooler.dense.bias": (hidden,)}
    if any(key.startswith("lm_head.") for key in weights):
        head_shapes = {"lm_head.dense.weight": (hidden, hidden), "lm_head.decoder.bias": (padded,)}
        expected |= {key: head_shapes.get(key, (hidden,)) for key in HEAD_RENAMES if key != "lm_head.decoder.weight"}
        optional["lm_head.decoder.weight"] = (padded, hidden)
    return expected, optional


def _backbone(weights: Mapping[str, torch.Tensor], config: transformers.EsmConfig, prefix: str, layout: str
              ) -> dict[str, torch.Tensor]:
    """EsmModel's state dict from checked TransformerEngine weights: QKV split, vocabulary cut."""
    backbone = {new: weights[prefix + old] for old, new in TOP_RENAMES.items() if prefix + old in weights}
    embeddings = "embeddings.word_embeddings.weight"
    backbone[embeddings] = backbone[embeddings][:config.vocab_size].contiguous()
    parts = ("query", "key", "value")
    for i in range(config.num_hidden_layers):
        old, new = f"{prefix}encoder.layers.{i}.", f"encoder.layer.{i}."
        backbone |= {new + esm: weights[old + te] for te, esm in LAYER_RENAMES.items()}
        for leaf in ("weight", "bias"):
            if layout == "separate":
                split = tuple(weights[f"{old}self_attention.layernorm_qkv.{part}_{leaf}"] for part in parts)
            else:
                split = _split_qkv(weights[f"{old}self_attention.layernorm_qkv.{leaf}"], layout,
                                   config.num_attention_heads)
            backbone |= {f"{new}attention.self.{part}.{leaf}": tensor for part, tensor in zip(parts, split)}
    return backbone


def _head(weights: Mapping[str, torch.Tensor], config: transformers.EsmConfig, raw: Mapping[str, Any]
          ) -> HeadWeights | None:
    """NVEsmLMHead as HeadWeights (exact GELU, the config's epsilon), its padded rows cut; None
    without `lm_head.` keys."""
    found = {HEAD_RENAMES[key]: weights[key] for key in HEAD_RENAMES if key in weights}
    if not found:
        return None
    for name in ("bias", "decoder.weight"):
        if name in found:
            found[name] = found[name][:config.vocab_size].contiguous()
    assert config.layer_norm_eps is not None  # nv_esm_config set it (NVEsmConfig's default when absent)
    return HeadWeights(found, {new: old for old, new in HEAD_RENAMES.items()}, activation="gelu",
                       layer_norm_eps=float(config.layer_norm_eps), tied=bool(raw.get("tie_word_embeddings", True)))


def _classifier(checkpoint: Checkpoint, keys: Mapping[str, torch.Tensor]) -> ClassifierWeights | None:
    """NVEsmForTokenClassification's `classifier` (per token) when the file or config.json's
    architectures have one; build_classifier checks its keys and shapes."""
    source = str(checkpoint.path / "config.json")
    kind = "token" if keys else classifier_kind(checkpoint.config)
    if kind is None:
        return None
    if kind == "sequence":
        raise CheckpointError(f"{source}: architectures name a sequence classifier, which NVIDIA's TransformerEngine "
                              "ESM-2 does not have; only NVEsmForTokenClassification is read")
    labels, problem_type = config_labels(checkpoint.config, source)
    return ClassifierWeights({CLASSIFIER_RENAMES.get(key, key): tensor for key, tensor in keys.items()},
                             {new: old for old, new in CLASSIFIER_RENAMES.items()}, labels, problem_type,
                             per_token=True)


def check_tokenizer_json(checkpoint: Checkpoint, alphabet: Sequence[str]) -> None:
    """A tokenizer.json in the checkpoint must map the ESM-2 alphabet to its ids (the WordLevel
    vocabulary NVIDIA's exports carry), or the served token ids would be wrong."""
    if "tokenizer.json" not in checkpoint.files:
        return
    path = checkpoint.path / "tokenizer.json"
    try:
        vocab = json.loads(checkpoint.text("tokenizer.json"))["model"]["vocab"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path} is not a tokenizer with a vocabulary ({type(err).__name__}: {err})") from None
    if not isinstance(vocab, dict):
        raise CheckpointError(f"{path}: model.vocab is not a token -> id table; expected the ESM-2 alphabet")
    for token_id, token in enumerate(alphabet):
        if vocab.get(token) != token_id:
            raise CheckpointError(f"{path} is not the ESM-2 alphabet: {token!r} has id {vocab.get(token)!r}, "
                                  f"expected {token_id}")
    if extra := sorted(set(vocab) - set(alphabet)):
        raise CheckpointError(f"{path} has tokens outside the ESM-2 alphabet: {some(extra)}")
