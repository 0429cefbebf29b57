"""ESM C (ESM Cambrian 300M / 600M / 6B), read into transformers' own `EsmcModel` from a Hugging
Face directory (`EsmcModel`, `EsmcForMaskedLM`, `EsmcForSequenceClassification`,
`EsmcForTokenClassification`; model_type `esmc`).

Its blocks differ from ESM-2's: pre-norm, no biases in the linears, a LayerNorm over the whole
query and key projections, rotary positions, a SwiGLU feed-forward, residual branches scaled by
sqrt(layers / 36), a final LayerNorm without bias; transformers' classes compute all of it, so the
family supplies only the key layout, the tokenizer and the heads:

- the tokenizer is ESM-2's character alphabet with one difference, id 31 is the chain break `|`
  (ESM-2's `<null_1>`); `<cls>` + residues + `<eos>`, ids padded to a 64-row embedding;
- the masked-LM head (`lm_head`: dense -> GELU -> LayerNorm -> decoder with its own bias, untied)
  is `LoadedModel.lm_head`; `EsmcForSequenceClassification`'s head reads `<cls>` through dense ->
  tanh -> out_proj as ESM-2's does, and the token head is one linear layer.

The `esm` package's own weight files (readers/esm_weights.py) are mapped key by key to
EsmcForMaskedLM's names, then read as a Hugging Face directory:

    esm package (ESMC)                                  EsmcForMaskedLM
    embed.weight                                        esmc.embed_tokens.weight
    transformer.blocks.i.attn.layernorm_qkv.0.*         esmc.layers.i.input_layernorm.*
    transformer.blocks.i.attn.layernorm_qkv.1.weight    esmc.layers.i.self_attn.{q,k,v}_proj.weight (thirds, in order)
    transformer.blocks.i.attn.q_ln.weight / k_ln        esmc.layers.i.self_attn.q_norm.weight / k_norm
    transformer.blocks.i.attn.out_proj.weight           esmc.layers.i.self_attn.o_proj.weight
    transformer.blocks.i.ffn.0.*                        esmc.layers.i.post_attention_layernorm.*
    transformer.blocks.i.ffn.1.weight                   esmc.layers.i.mlp.{gate,up}_proj.weight (halves: SwiGLU's
                                                        silu(first) * second)
    transformer.blocks.i.ffn.3.weight                   esmc.layers.i.mlp.down_proj.weight
    transformer.norm.weight                             esmc.norm.weight
    sequence_head.0.* / .2.* / .3.*                     lm_head.dense.* / lm_head.layer_norm.* / lm_head.decoder.*

The file has no config: width, layers and the SwiGLU width come from the tensors, the heads from
ESM C's 64-wide heads (300M: 960 / 15, 600M: 1152 / 18, 6B: 2560 / 40).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import torch
import transformers
from transformers.initialization import no_init_weights

from bionemo_export.models.base import ModelDescription, leave_out, register
from bionemo_export.models.encoder import HuggingFaceEncoderFamily, token_limit
from bionemo_export.models.esm2 import ESM_CLASSIFIER_RENAMES, esm_classifier_kind
from bionemo_export.models.lm_head import HeadWeights
from bionemo_export.models.readers import Checkpoint, CheckpointError
from bionemo_export.serving.tokenizers.character import MASK_CHAR, CharacterTokenizer
from bionemo_export.tasks import Requirement

RESIDUES = "LAGVSERTIDPKQNFYMHWCXBUZO"
ALPHABET = ["<cls>", "<pad>", "<eos>", "<unk>", *RESIDUES, ".", "-", "|", "<mask>"]
"""ESM C's 33 token ids, in order (transformers' EsmcTokenizer SEQUENCE_VOCAB); the embedding has 64
rows, the rest unused."""
HEAD_WIDTH = 64
"""Every released ESM C's attention head width."""
MAX_TOKENS = 2048
"""The context ESM C was trained with (EsmcConfig.max_position_embeddings); rotary positions set no
hard limit, --max-length lowers it."""


@register
class EsmcFamily(HuggingFaceEncoderFamily):
    name = "esmc"
    may_carry = frozenset({Requirement.ENCODER, Requirement.LM_HEAD, Requirement.ONE_CHARACTER_RESIDUES,
                           Requirement.CLASSIFIER, Requirement.ATTENTION_PROBABILITIES})
    """its masked-LM head and a fine-tuned head where the checkpoint has them."""
    claimed_forms = ("esm_weights",)  # the esm package's ESM C weight files
    description = ("ESM C / ESM Cambrian protein language model (pre-norm, QK LayerNorm, rotary, SwiGLU): "
                   "Hugging Face EsmcModel directory")
    model_type = "esmc"
    config_class = transformers.EsmcConfig
    backbone_class = transformers.EsmcModel
    key_prefix = "esmc."
    unused_prefixes = ("lm_head.", "classifier.")
    head_prefix = "lm_head."
    head_renames = {"decoder.bias": "bias"}
    """EsmcMaskedLMHead's decoder has its own bias: the head's `bias`."""
    classifier_renames = ESM_CLASSIFIER_RENAMES

    def guess_classifier(self, keys: Any) -> str | None:
        return esm_classifier_kind(keys)

    def from_esm_weights(self, checkpoint: Checkpoint, max_length: int | None) -> ModelDescription:
        """The esm package's weight file, read as the EsmcForMaskedLM checkpoint it maps to (see the module)."""
        weights = _huggingface_weights(checkpoint)
        return self.from_huggingface(dataclasses.replace(checkpoint, weights=weights,
                                                         config=_config(weights, checkpoint)), max_length)

    def make_backbone(self, config: Any) -> torch.nn.Module:
        with no_init_weights():  # strict loading sets every parameter
            return transformers.EsmcModel(config)

    def build_tokenizer(self, checkpoint: Checkpoint, config: Any, max_length: int | None) -> CharacterTokenizer:
        _check_tokenizer_file(checkpoint)
        limit = min(MAX_TOKENS, int(getattr(config, "max_position_embeddings", MAX_TOKENS) or MAX_TOKENS))
        return CharacterTokenizer(ALPHABET, residues=RESIDUES, pad_token="<pad>", bos_token="<cls>",
                                  eos_token="<eos>", unk_token="<unk>", mask_token="<mask>", mask_char=MASK_CHAR,
                                  max_length=token_limit(limit, max_length, "ESM C"))

    def head_settings(self, weights: dict[str, torch.Tensor], names: dict[str, str], config: Any,
                      checkpoint: Checkpoint) -> HeadWeights:
        """EsmcMaskedLMHead: exact GELU, torch's default LayerNorm epsilon, its own decoder."""
        return HeadWeights(weights, names, activation="gelu", layer_norm_eps=1e-5, tied=False)

    def sample_sequences(self) -> list[str]:
        return [
            "MKTAY",
            "MSLKRKNIALIPAAGIGVRFG",
            "FVNQHLCGSHLVEALYLVCGERGFFYTPKT",
            "LAGVSERTIDPKQNFYMHWCXBUZO",
            "MQIFVKTLTGKTITLEVEPSDTIENVKAKIQDKEGIPPDQQRLIFAGKQLEDGRTLSDYNIQKESTLHLVLRLRGG",
        ]


def _check_tokenizer_file(checkpoint: Checkpoint) -> None:
    """A tokenizer.json beside the weights must hold ESM C's ids (the ids are in the weights)."""
    path = checkpoint.path / "tokenizer.json"
    if "tokenizer.json" not in checkpoint.files:
        return
    try:
        vocab = json.loads(checkpoint.files["tokenizer.json"])["model"]["vocab"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path}: not a tokenizer.json with a model vocabulary") from None
    wrong = [f"{token!r} is {vocab.get(token)}" for index, token in enumerate(ALPHABET)
             if isinstance(vocab, dict) and vocab.get(token) != index]
    if wrong:
        raise CheckpointError(f"{path}: not ESM C's vocabulary ({', '.join(wrong[:4])}; expected ids 0-32 in "
                              "EsmcTokenizer's order)")


_BLOCK = re.compile(r"transformer\.blocks\.(\d+)\.(.+)")
_BLOCK_NAMES = {"attn.layernorm_qkv.0.weight": "input_layernorm.weight",
                "attn.layernorm_qkv.0.bias": "input_layernorm.bias",
                "attn.q_ln.weight": "self_attn.q_norm.weight", "attn.k_ln.weight": "self_attn.k_norm.weight",
                "attn.out_proj.weight": "self_attn.o_proj.weight",
                "ffn.0.weight": "post_attention_layernorm.weight", "ffn.0.bias": "post_attention_layernorm.bias",
                "ffn.3.weight": "mlp.down_proj.weight"}
_OTHER_NAMES = {"embed.weight": "esmc.embed_tokens.weight", "transformer.norm.weight": "esmc.norm.weight",
                "sequence_head.0.weight": "lm_head.dense.weight", "sequence_head.0.bias": "lm_head.dense.bias",
                "sequence_head.2.weight": "lm_head.layer_norm.weight",
                "sequence_head.2.bias": "lm_head.layer_norm.bias",
                "sequence_head.3.weight": "lm_head.decoder.weight", "sequence_head.3.bias": "lm_head.decoder.bias"}


def _huggingface_weights(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """The esm package's ESMC keys under EsmcForMaskedLM's names: the fused QKV cut in thirds, the
    fused SwiGLU input in halves (gate, then up)."""
    weights: dict[str, torch.Tensor] = {}
    for key, tensor in checkpoint.weights.items():
        if key in _OTHER_NAMES:
            weights[_OTHER_NAMES[key]] = tensor
            continue
        match = _BLOCK.fullmatch(key)
        rest = match[2] if match else ""
        if match is None or rest.endswith("inv_freq"):
            if key.endswith("inv_freq"):
                leave_out(key, "the rotary table: computed from the config")
                continue
            raise CheckpointError(f"{checkpoint.weights_path}: unexpected key {key} for an ESM C weight file")
        layer = f"esmc.layers.{match[1]}."
        if rest == "attn.layernorm_qkv.1.weight":
            if tensor.shape[0] % 3:
                raise CheckpointError(f"{checkpoint.weights_path}: {key} has {tensor.shape[0]} rows, not 3 x width")
            for name, part in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0), strict=True):
                weights[f"{layer}self_attn.{name}.weight"] = part
        elif rest == "ffn.1.weight":
            if tensor.shape[0] % 2:
                raise CheckpointError(f"{checkpoint.weights_path}: {key} has {tensor.shape[0]} rows, not 2 x the "
                                      "SwiGLU width")
            gate, up = tensor.chunk(2, dim=0)
            weights[f"{layer}mlp.gate_proj.weight"], weights[f"{layer}mlp.up_proj.weight"] = gate, up
        elif rest in _BLOCK_NAMES:
            weights[layer + _BLOCK_NAMES[rest]] = tensor
        else:
            raise CheckpointError(f"{checkpoint.weights_path}: unexpected key {key} for an ESM C weight file")
    return weights


def _config(weights: dict[str, torch.Tensor], checkpoint: Checkpoint) -> dict[str, Any]:
    """EsmcConfig's settings from the tensors' shapes (the file has none)."""
    vocab, hidden = weights["esmc.embed_tokens.weight"].shape
    if hidden % HEAD_WIDTH:
        raise CheckpointError(f"{checkpoint.weights_path}: width {hidden} is not a multiple of ESM C's "
                              f"{HEAD_WIDTH}-wide heads")
    layers = 1 + max(int(key.split(".")[2]) for key in weights if key.startswith("esmc.layers."))
    intermediate = weights["esmc.layers.0.mlp.down_proj.weight"].shape[1]
    return {"model_type": "esmc", "architectures": ["EsmcForMaskedLM"], "vocab_size": int(vocab),
            "hidden_size": int(hidden), "num_hidden_layers": layers, "num_attention_heads": int(hidden) // HEAD_WIDTH,
            "intermediate_size": int(intermediate), "max_position_embeddings": MAX_TOKENS, "pad_token_id": 1,
            "mask_token_id": 32}
