"""ESM-1 (learned absolute positions, pre-LN) in two forms:

- a BioNeMo ESM-1nv `.nemo` archive: a NeMo Megatron BERT (positions counted from 0, GELU exact
  or tanh per `bias_gelu_fusion`), built as the project's own `transformer.Encoder`; its tokenizer
  is the 30-piece character SentencePiece vocabulary the archive carries as an artifact
  (`<unk>`0 `<s>`1 `</s>`2 `<pad>`3 `<mask>`4, residues 5..29; `<s>` + residues + `</s>`, at most
  512 tokens);
- a Hugging Face ESM-1b-style directory: transformers' `EsmModel` with
  `position_embedding_type: "absolute"` and the 33-token ESM alphabet (`<cls>` + residues +
  `<eos>`). Hugging Face numbers absolute positions from `pad_token_id + 1`, so such a model
  takes `max_position_embeddings - pad_token_id - 1` tokens (1024 for ESM-1b).

Both forms read their masked-LM head when the checkpoint has one (the archive's `model.lm_head`,
EsmForMaskedLM's `lm_head`): see esm2.py and lm_head.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bionemo_export.models.base import ModelDescription, register
from bionemo_export.models.encoder import token_limit
from bionemo_export.models.esm2 import Esm2Family, check_alphabet, esm_tokenizer
from bionemo_export.models.megatron import (
    bert_encoder_keys,
    cut_vocab,
    megatron_lm_head,
    strip_model_prefix,
    transformer_config,
)
from bionemo_export.models.readers import Checkpoint, CheckpointError
from bionemo_export.models.readers.nemo import sentencepiece_pieces, setting
from bionemo_export.serving.tokenizers.character import MASK_CHAR, CharacterTokenizer, find_mask_token
from bionemo_export.serving.tokenizers.sentencepiece_vocab import SentencePieceTokenizer
from bionemo_export.tasks import Requirement

ESM1NV_RESIDUES = "LASGVERTDIPKNFQYHMCWXBZUO"
ESM1NV_PIECES = ["<unk>", "<s>", "</s>", "<pad>", "<mask>", *ESM1NV_RESIDUES]
"""The 30 ESM-1nv token ids, in order (docs/reference/tokenizers.md); the archive's own
tokenizer artifact is what the importer reads."""
ESM1NV_MAX_TOKENS = 512
"""ESM-1nv's length limit: <s> + 510 residues + </s>."""
ESM1B_MAX_POSITIONS = 1026
"""The released ESM-1b's max_position_embeddings (1024 tokens after Hugging Face's offset)."""


@register
class Esm1Family(Esm2Family):
    name = "esm1"
    may_carry = frozenset({Requirement.ENCODER, Requirement.LM_HEAD, Requirement.ONE_CHARACTER_RESIDUES,
                           Requirement.CONTACT_HEAD, Requirement.ATTENTION_PROBABILITIES})
    """no fine-tuned heads for ESM-1; the contact head in Hugging Face ESM-1b-style directories (ESM-1nv archives
    have none)."""
    claimed_forms = ()  # nv_esm directories are ESM-2's
    classifier_renames = {}
    """No fine-tuned heads read for ESM-1 (docs/models.md's family table); classifier keys are dropped."""
    description = ("ESM-1 protein language model (learned absolute positions, pre-LN): ESM-1nv .nemo, "
                   "a Hugging Face ESM-1b-style EsmModel, or fair-esm's ESM-1b / ESM-1v .pt file")
    nemo_targets = ("ESM1nvModel",)
    position_embedding_type = "absolute"
    from_nemo2: None = None
    from_nv_esm: None = None
    """ESM-2-only forms (BioNeMo 2 and NVIDIA's TransformerEngine export): not inherited."""

    # ------------------------------------------------------------- Hugging Face directory
    def build_tokenizer(self, checkpoint: Checkpoint, config: Any, max_length: int | None) -> CharacterTokenizer:
        check_alphabet(checkpoint)
        return esm_tokenizer(token_limit(huggingface_token_limit(config, checkpoint.path), max_length,
                                         "this ESM-1b model"))

    # ------------------------------------------------------------- ESM-1nv .nemo archive
    def from_nemo(self, checkpoint: Checkpoint, max_length: int | None) -> ModelDescription:
        """An ESM-1nv archive: Megatron BERT weights, SentencePiece tokenizer artifact."""
        pieces = sentencepiece_pieces(checkpoint, "ESM-1nv")
        config = transformer_config(checkpoint, vocab_size=len(pieces))
        seq_length = int(setting(checkpoint, "seq_length", default=config.max_position_embeddings))
        limit = min(seq_length, config.max_position_embeddings)
        tokenizer = esm1nv_tokenizer(pieces, token_limit(limit, max_length, "this ESM-1nv model"),
                                     f"{checkpoint.path}: the tokenizer artifact")
        source = checkpoint.weights_path
        weights, head = megatron_lm_head(strip_model_prefix(checkpoint.weights), checkpoint)
        weights = bert_encoder_keys(weights, config.num_heads, source)
        key = "embedding.word_embeddings.weight"
        if key in weights:
            weights[key] = cut_vocab(weights[key], len(pieces), "model.language_model.embedding.word_embeddings.weight",
                                     source)
        return ModelDescription(checkpoint, config, tokenizer, weights,
                                facts={"nemo_target": checkpoint.model_class, "activation": config.activation},
                                lm_head=head)


def huggingface_token_limit(config: Any, checkpoint: Path | str = "config.json") -> int:
    """Most tokens an absolute-position Hugging Face ESM model takes: its positions run from
    pad_token_id + 1 (transformers' create_position_ids_from_input_ids) to
    max_position_embeddings - 1."""
    limit = int(config.max_position_embeddings) - int(config.pad_token_id) - 1
    if limit < 3:
        raise CheckpointError(f"{checkpoint}: max_position_embeddings {config.max_position_embeddings} leaves no "
                              f"room for residues (positions start at pad_token_id + 1 = {config.pad_token_id + 1})")
    return limit


def esm1nv_tokenizer(pieces: list[str], max_length: int, source: str = "the vocabulary") -> SentencePieceTokenizer:
    """`<s>` + residues + `</s>` over an ESM-1nv piece vocabulary, padded with `<pad>`."""
    try:
        mask_token = find_mask_token(pieces)
        return SentencePieceTokenizer(pieces, residues=ESM1NV_RESIDUES, pad_token="<pad>", bos_token="<s>",
                                      eos_token="</s>", unk_token="<unk>", max_length=max_length,
                                      mask_token=mask_token, mask_char=MASK_CHAR if mask_token else None)
    except ValueError as err:
        raise CheckpointError(f"{source} is not an ESM-1nv vocabulary: {err}") from None
