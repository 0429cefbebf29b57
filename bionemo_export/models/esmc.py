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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.initialization import no_init_weights

from bionemo_export.models.base import register
from bionemo_export.models.encoder import HuggingFaceEncoderFamily, token_limit
from bionemo_export.models.lm_head import HeadWeights
from bionemo_export.models.readers import Checkpoint, CheckpointError
from bionemo_export.tokenizers.character import MASK_CHAR, CharacterTokenizer

RESIDUES = "LAGVSERTIDPKQNFYMHWCXBUZO"
ALPHABET = ["<cls>", "<pad>", "<eos>", "<unk>", *RESIDUES, ".", "-", "|", "<mask>"]
"""ESM C's 33 token ids, in order (transformers' EsmcTokenizer SEQUENCE_VOCAB); the embedding has 64
rows, the rest unused."""
MAX_TOKENS = 2048
"""The context ESM C was trained with (EsmcConfig.max_position_embeddings); rotary positions set no
hard limit, --max-length lowers it."""


@register
class EsmcFamily(HuggingFaceEncoderFamily):
    name = "esmc"
    tasks = ("embeddings", "hiddens", "logits", "scores", "predictions")
    """logits and scores where the checkpoint has its masked-LM head, predictions where it has a
    fine-tuned head."""
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
    classifier_renames = {
        "sequence": {"classifier.dense.weight": "dense.weight", "classifier.dense.bias": "dense.bias",
                     "classifier.out_proj.weight": "out.weight", "classifier.out_proj.bias": "out.bias"},
        "token": {"classifier.weight": "out.weight", "classifier.bias": "out.bias"},
    }

    def guess_classifier(self, keys: Any) -> str | None:
        if "classifier.out_proj.weight" in keys or "classifier.dense.weight" in keys:
            return "sequence"
        return "token" if "classifier.weight" in keys else None

    def make_backbone(self, config: Any) -> torch.nn.Module:
        with no_init_weights():  # strict loading sets every parameter
            return transformers.EsmcModel(config)

    def build_tokenizer(self, checkpoint: Path, config: Any, max_length: int | None) -> CharacterTokenizer:
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


def _check_tokenizer_file(checkpoint: Path) -> None:
    """A tokenizer.json beside the weights must hold ESM C's ids (the ids are in the weights)."""
    path = checkpoint / "tokenizer.json"
    if not path.is_file():
        return
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path}: not a tokenizer.json with a model vocabulary") from None
    wrong = [f"{token!r} is {vocab.get(token)}" for index, token in enumerate(ALPHABET)
             if isinstance(vocab, dict) and vocab.get(token) != index]
    if wrong:
        raise CheckpointError(f"{path}: not ESM C's vocabulary ({', '.join(wrong[:4])}; expected ids 0-32 in "
                              "EsmcTokenizer's order)")
