"""fair-esm checkpoints (readers/fair_esm.py) as Hugging Face EsmForMaskedLM checkpoints: the
settings become an EsmConfig and fairseq's names EsmForMaskedLM's, key by key, as transformers'
ESM conversion maps them. The esm2 and esm1 families then read the result as any Hugging Face
directory, so a fair-esm file computes exactly what the same weights compute in transformers'
EsmForMaskedLM (tests/export/test_fair_esm.py checks it against fair-esm's own modules).

    fair-esm (after its own prefix removal)          EsmForMaskedLM
    embed_tokens.weight                               esm.embeddings.word_embeddings.weight
    embed_positions.weight (ESM-1b/1v)                esm.embeddings.position_embeddings.weight
    emb_layer_norm_before.* (ESM-1b/1v)               esm.embeddings.layer_norm.*
    layers.i.self_attn.{q,k,v}_proj.*                 esm.encoder.layer.i.attention.self.{query,key,value}.*
    layers.i.self_attn.out_proj.*                     esm.encoder.layer.i.attention.output.dense.*
    layers.i.self_attn_layer_norm.*                   esm.encoder.layer.i.attention.LayerNorm.*
    layers.i.fc1.* / fc2.*                            esm.encoder.layer.i.intermediate.dense.* / output.dense.*
    layers.i.final_layer_norm.*                       esm.encoder.layer.i.LayerNorm.*
    emb_layer_norm_after.*                            esm.encoder.emb_layer_norm_after.*
    lm_head.dense.*, lm_head.layer_norm.*, lm_head.bias   lm_head.dense.*, lm_head.layer_norm.*, lm_head.bias
    lm_head.weight (the word embeddings, tied)        lm_head.decoder.weight
    contact_head.regression.*                         esm.contact_head.regression.*

ESM-2's rotary frequency tables (`rot_emb.inv_freq`) are computed from the config, not read. The
original ESM-1 (`protein_bert_base`), the MSA Transformer and the inverse-folding models have no
EsmModel counterpart and are refused by name.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from bionemo_export.models.base import leave_out
from bionemo_export.models.readers import Checkpoint, CheckpointError

ARCHITECTURES = {"esm2": "esm2", "roberta_large": "esm1"}
"""fair-esm architecture -> the family that serves it."""
PREFIXES = re.compile(r"^(encoder\.sentence_encoder\.|encoder\.)")
"""What fair-esm's loader strips from the stored names (both ESM-2 and ESM-1b)."""
LAYER_NAMES = {"self_attn.q_proj": "attention.self.query", "self_attn.k_proj": "attention.self.key",
               "self_attn.v_proj": "attention.self.value", "self_attn.out_proj": "attention.output.dense",
               "self_attn_layer_norm": "attention.LayerNorm", "fc1": "intermediate.dense", "fc2": "output.dense",
               "final_layer_norm": "LayerNorm"}
OTHER_NAMES = {"embed_tokens.weight": "esm.embeddings.word_embeddings.weight",
               "embed_positions.weight": "esm.embeddings.position_embeddings.weight",
               "emb_layer_norm_before.weight": "esm.embeddings.layer_norm.weight",
               "emb_layer_norm_before.bias": "esm.embeddings.layer_norm.bias",
               "emb_layer_norm_after.weight": "esm.encoder.emb_layer_norm_after.weight",
               "emb_layer_norm_after.bias": "esm.encoder.emb_layer_norm_after.bias",
               "lm_head.weight": "lm_head.decoder.weight",
               "contact_head.regression.weight": "esm.contact_head.regression.weight",
               "contact_head.regression.bias": "esm.contact_head.regression.bias"}
PASSED_ON = ("lm_head.dense.", "lm_head.layer_norm.", "lm_head.bias")
MASK_ID, PAD_ID = 32, 1
"""fair-esm's ESM-1b alphabet (the 33 tokens of ESM-2 too): <mask> and <pad>."""


def family_of(checkpoint: Checkpoint) -> str:
    """The family that serves this fair-esm checkpoint, or CheckpointError naming what it is."""
    architecture = checkpoint.config.get("architecture")
    if architecture not in ARCHITECTURES:
        raise CheckpointError(f"{checkpoint.path}: fair-esm architecture {architecture!r} is not served (the original "
                              "ESM-1, protein_bert_base, the MSA Transformer and the inverse-folding models have no "
                              "EsmModel counterpart); ESM-2, ESM-1b and ESM-1v files are")
    return ARCHITECTURES[architecture]


def as_huggingface(checkpoint: Checkpoint, family: str) -> Checkpoint:
    """`checkpoint` (form fair_esm) with an EsmConfig's config.json and EsmForMaskedLM's key names."""
    if family_of(checkpoint) != family:
        raise CheckpointError(f"{checkpoint.path} is a fair-esm {checkpoint.model_class} file: use `family` "
                              f"{family_of(checkpoint)}")
    source = checkpoint.weights_path
    weights: dict[str, torch.Tensor] = {}
    for stored, tensor in checkpoint.weights.items():
        name = PREFIXES.sub("", stored)
        if name.endswith("rot_emb.inv_freq"):
            leave_out(stored, "the rotary table: computed from the config")
            continue
        renamed = _huggingface_name(name)
        if renamed is None:
            raise CheckpointError(f"{source}: unexpected key {stored} for a fair-esm {checkpoint.model_class} file")
        weights[renamed] = tensor
    config = _config(checkpoint, weights, family)
    if family == "esm1" and "esm.embeddings.word_embeddings.weight" in weights:
        # fair-esm zeroes ESM-1b's <mask> embedding when it loads (its token dropout); so does this.
        table = weights["esm.embeddings.word_embeddings.weight"].clone()
        table[MASK_ID] = 0.0
        weights["esm.embeddings.word_embeddings.weight"] = table
    return dataclasses.replace(checkpoint, config=config, weights=weights)


def _huggingface_name(name: str) -> str | None:
    if name in OTHER_NAMES:
        return OTHER_NAMES[name]
    if name.startswith(PASSED_ON):
        return name
    match = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if match and match[2] in LAYER_NAMES:
        return f"esm.encoder.layer.{match[1]}.{LAYER_NAMES[match[2]]}.{match[3]}"
    return None


def _config(checkpoint: Checkpoint, weights: dict[str, torch.Tensor], family: str) -> dict[str, Any]:
    """EsmConfig's settings: sizes from the weights (what the file really holds), heads and token
    dropout from the file's settings, the rest as transformers' ESM conversion sets them."""
    source = checkpoint.weights_path
    # ESM-1b/1v files name their sizes as fairseq does (encoder_attention_heads, ...); fair-esm's
    # loader strips "encoder_", as this does; ESM-2's cfg keeps the prefix.
    settings = {key.removeprefix("encoder_") if family == "esm1" else key: value
                for key, value in checkpoint.config.items()}
    try:
        vocab, hidden = weights["esm.embeddings.word_embeddings.weight"].shape
        intermediate = weights["esm.encoder.layer.0.intermediate.dense.weight"].shape[0]
    except KeyError as err:
        raise CheckpointError(f"{source}: no {err.args[0]} (renamed from fair-esm's name): not a complete "
                              "model") from None
    layers = 1 + max(int(key.split(".")[3]) for key in weights if key.startswith("esm.encoder.layer."))
    heads = settings.get("encoder_attention_heads" if family == "esm2" else "attention_heads")
    if not isinstance(heads, int) or heads < 1 or hidden % heads:
        raise CheckpointError(f"{checkpoint.path}: its settings give {heads!r} attention heads for width {hidden}")
    config: dict[str, Any] = {
        "model_type": "esm", "architectures": ["EsmForMaskedLM"], "vocab_size": int(vocab),
        "hidden_size": int(hidden), "num_hidden_layers": layers, "num_attention_heads": heads,
        "intermediate_size": int(intermediate), "pad_token_id": PAD_ID, "mask_token_id": MASK_ID,
        "layer_norm_eps": 1e-5, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "token_dropout": bool(settings.get("token_dropout", family == "esm2")), "tie_word_embeddings": True,
    }
    if family == "esm2":
        config |= {"position_embedding_type": "rotary", "max_position_embeddings": 1026,
                   "emb_layer_norm_before": False}
    else:
        positions = weights.get("esm.embeddings.position_embeddings.weight")
        if positions is None:
            raise CheckpointError(f"{source}: no embed_positions.weight: not an ESM-1b/1v model")
        config |= {"position_embedding_type": "absolute", "max_position_embeddings": int(positions.shape[0]),
                   "emb_layer_norm_before": "esm.embeddings.layer_norm.weight" in weights}
    return config
