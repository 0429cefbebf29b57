"""ProtT5: the encoder of a T5 protein language model, from a Hugging Face directory (ProtTrans'
ProtT5, `T5EncoderModel` or `T5ForConditionalGeneration`) or a BioNeMo ProtT5nv `.nemo` archive.

The two forms are different models that share a name, and they are served the way each was trained:

- Hugging Face ProtT5 (T5 v1: relative position buckets, RMS LayerNorm, no biases), run as
  transformers' `T5EncoderModel`. Input as ProtTrans prepares it: residues separated by spaces
  (accepted with or without them), the rare residues U Z O B mapped to X, `</s>` appended, no BOS.
  The vocabulary comes from the folder's `tokenizer.json` or `spiece.model` (`▁A`, `▁L`, ... word
  pieces; the ids equal those of transformers' T5Tokenizer for that folder). `mask` covers the
  residues only (not `</s>`), so embeddings are the mean over residues, as ProtTrans computes them.
- ProtT5nv (NeMo Megatron T5: pre-LN, learned absolute positions, GELU), of which only the encoder
  is read, into the project's own `transformer.Encoder`. The vocabulary is the archive's
  SentencePiece artifact (ESM-1nv's 30 bare pieces) extended the way NeMo's T5 extends it
  (`<cls>`, `<sep>`, then the `<extra_id_N>` sentinels); no BOS/EOS, so `mask` is the padding mask
  and embeddings are the mean over every non-pad position (docs/reference/tokenizers.md).
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from transformers.initialization import no_init_weights

from bionemo_export.models.base import ModelDescription, leave_out, register
from bionemo_export.models.encoder import HuggingFaceEncoderFamily, token_limit
from bionemo_export.models.megatron import cut_vocab, encoder_decoder_keys, transformer_config
from bionemo_export.models.readers import Checkpoint, CheckpointError
from bionemo_export.models.readers.nemo import sentencepiece_pieces, setting
from bionemo_export.models.transformer import TransformerConfig
from bionemo_export.serving.tokenizers.sentencepiece_vocab import WORD_START, SentencePieceTokenizer, read_pieces
from bionemo_export.tasks import Requirement

RESIDUES = "LAGVSERTIDPKQNFYMHWCXBUZO"
"""Every residue letter accepted (the 20 standard amino acids, X, and the rare B U Z O)."""
RARE = "UZOB"
"""Residues ProtTrans replaces with X before tokenizing (Hugging Face ProtT5 only)."""
PROTT5_PIECES = ["<pad>", "</s>", "<unk>", *(WORD_START + c for c in "ALGVSREDTIPKFQNYMHWCXBOUZ")]
"""The pieces of ProtTrans' spiece.model, in id order (random checkpoints are written with them)."""
T5_EXTRA_IDS = 100
"""Sentinels transformers' T5Tokenizer adds after the pieces (tokenizer_config.json: extra_ids)."""

DEFAULT_MAX_TOKENS = 512
"""The Hugging Face form's default limit, `</s>` included. T5 has no position table, so the
architecture sets no limit (its relative position buckets saturate beyond 128 tokens apart); 512 is
the length ProtT5 was pre-trained on (config.json's `n_positions` when it says otherwise). The
user's --max-length replaces it, higher or lower: longer proteins run, at quadratic cost and
outside what the model saw in training."""

NEMO_ADDED = ("<cls>", "<sep>", "<mask>", "<pad>", "<s>", "</s>")
"""What NeMo's Megatron T5 adds to a SentencePiece vocabulary that lacks it, in this order, before
the sentinels (an existing piece keeps its id)."""
NEMO_SENTINELS = 96
"""ProtT5nv's `tokenizer.num_sentinel_tokens` (used when the config does not say)."""


@register
class ProtT5Family(HuggingFaceEncoderFamily):
    name = "prott5"
    may_carry = frozenset({Requirement.ENCODER, Requirement.ATTENTION_PROBABILITIES})
    """the encoder only (no masked-LM head): transformers' attention."""
    description = ("ProtT5 protein language model: the T5 encoder (Hugging Face T5EncoderModel / "
                   "T5ForConditionalGeneration; BioNeMo ProtT5nv .nemo)")
    model_type = "t5"
    config_class = transformers.T5Config
    backbone_class = transformers.T5EncoderModel
    key_prefix = ""
    unused_prefixes = ("decoder.", "lm_head.")
    """Dropped from T5ForConditionalGeneration checkpoints: only the encoder is served."""

    nemo_targets = ("ProtT5nvModel",)

    # ------------------------------------------------------------------ Hugging Face directory
    def build_tokenizer(self, checkpoint: Checkpoint, config: Any, max_length: int | None) -> SentencePieceTokenizer:
        pieces = _huggingface_pieces(checkpoint, config)
        default = int(getattr(config, "n_positions", None) or DEFAULT_MAX_TOKENS)
        limit = default if max_length is None else int(max_length)  # see DEFAULT_MAX_TOKENS
        try:
            return SentencePieceTokenizer(
                pieces, residues=RESIDUES, word_pieces=True, aliases={c: "X" for c in RARE},
                pad_token="<pad>", bos_token=None, eos_token="</s>", unk_token="<unk>", max_length=limit)
        except ValueError as err:
            raise CheckpointError(f"{checkpoint.path}: {err}") from None

    def huggingface_keys(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The encoder's weights: `decoder.*` and `lm_head.*` dropped; the token embeddings under
        `shared.weight` (files hold them as `shared.weight`, `encoder.embed_tokens.weight` or both)."""
        keys = super().huggingface_keys(weights)
        tied = keys.pop("encoder.embed_tokens.weight", None)
        if tied is not None:
            shared = keys.setdefault("shared.weight", tied)
            if shared.shape != tied.shape or not torch.equal(shared, tied):
                raise CheckpointError("encoder.embed_tokens.weight differs from shared.weight: the encoder's "
                                      "token embeddings are not tied to the shared ones; not supported")
        return keys

    def make_backbone(self, config: Any) -> torch.nn.Module:
        if isinstance(config, TransformerConfig):  # ProtT5nv: the project's pre-LN transformer
            return super().make_backbone(config)
        config = copy.deepcopy(config)
        # Eager attention: with transformers' SDPA path, torch.onnx cannot export T5's attention
        # (a view of SDPA's transposed output under dynamic shapes); both compute the same thing.
        config._attn_implementation = "eager"
        with no_init_weights():
            backbone = transformers.T5EncoderModel(config)  # T5 takes no add_pooling_layer
        # One module for both names, so that loading `shared.weight` (even by assignment) gives
        # the encoder its token embeddings too.
        backbone.encoder.embed_tokens = backbone.shared
        return backbone

    # ------------------------------------------------------------------ ProtT5nv .nemo
    def from_nemo(self, checkpoint: Checkpoint, max_length: int | None) -> ModelDescription:
        """A BioNeMo ProtT5nv archive: the encoder of a NeMo Megatron T5 (megatron.py's
        encoder-decoder layout; the decoder and output head are left out)."""
        pieces, added = nemo_vocabulary(checkpoint)
        config = transformer_config(checkpoint, len(pieces), ("encoder",))
        seq_length = int(setting(checkpoint, "seq_length", "encoder", default=config.max_position_embeddings))
        limit = token_limit(min(seq_length, config.max_position_embeddings), max_length, "this ProtT5nv model")
        try:
            tokenizer = SentencePieceTokenizer(pieces, residues=RESIDUES, pad_token="<pad>", bos_token=None,
                                               eos_token=None, unk_token="<unk>", max_length=limit)
        except ValueError as err:
            raise CheckpointError(f"{checkpoint.path}: the tokenizer artifact: {err}") from None
        source = checkpoint.weights_path
        # Only the encoder is served: the decoder's own embeddings (shared or not) do not matter.
        stored = {key: tensor for key, tensor in checkpoint.weights.items() if ".decoder_embedding." not in f".{key}"}
        weights = {}
        for key, tensor in encoder_decoder_keys(stored, config.num_heads, source).items():
            if key.startswith(("decoder.", "tokens_head.")):
                leave_out(key, "the decoder: ProtT5nv serves its encoder")
            else:
                weights[key] = tensor
        for key in checkpoint.weights.keys() - stored.keys():
            leave_out(key, "the decoder's embeddings: ProtT5nv serves its encoder")
        key = "embedding.word_embeddings.weight"
        if key in weights:  # padded to a multiple of make_vocab_size_divisible_by: keep real ids only
            weights[key] = cut_vocab(weights[key], len(pieces), key, source)
        return ModelDescription(checkpoint, config, tokenizer, weights, facts={
            "nemo_target": checkpoint.model_class, "activation": config.activation,
            "vocabulary": f"{len(pieces)} tokens ({len(pieces) - added} from the artifact, {added} added as NeMo does)",
        })

    def sample_sequences(self) -> list[str]:
        return [
            "MKTAY",
            "MSLKRKNIALIPAAGIGVRFG",
            "FVNQHLCGSHLVEALYLVCGERGFFYTPKT",
            "LAGVSERTIDPKQNFYMHWCXBUZO",  # every residue letter, rare ones included
            "MQIFVKTLTGKTITLEVEPSDTIENVKAKIQDKEGIPPDQQRLIFAGKQLEDGRTLSDYNIQKESTLHLVLRLRGG",
            "MSKGEELFTGVVPILVELDGDVNGHKFSVSGEGEGDATYGKLTLKFICTTGKLPVPWPTLVTTFSYGVQCFSRYPDHMKQ"
            "HDFFKSAMPEGYVQERTIFFKDDGNYKTRAEVKFEGDTLV",
        ]


# ---------------------------------------------------------------------------- vocabularies
def _huggingface_pieces(checkpoint: Checkpoint, config: Any) -> list[str]:
    """The vocabulary of a Hugging Face ProtT5 folder (from the side files its reader read), ids as
    transformers' T5Tokenizer gives them: tokenizer.json (what the fast tokenizer reads first) or
    spiece.model plus the `<extra_id_N>` sentinels that T5Tokenizer appends in reverse order
    (`<extra_id_0>` last)."""
    for name in ("tokenizer.json", "spiece.model"):
        if name in checkpoint.files:
            try:
                pieces = read_pieces(checkpoint.files[name], str(checkpoint.path / name))
            except ValueError as err:
                raise CheckpointError(str(err)) from None
            break
    else:
        raise CheckpointError(f"checkpoint {checkpoint.path} has no tokenizer: expected spiece.model or tokenizer.json")
    if name == "spiece.model":
        extra = T5_EXTRA_IDS
        if "tokenizer_config.json" in checkpoint.files:
            try:
                extra = int(json.loads(checkpoint.files["tokenizer_config.json"]).get("extra_ids", extra))
            except (ValueError, TypeError, AttributeError, UnicodeDecodeError):
                pass  # a broken tokenizer_config.json: the default, which only adds unused ids
        sentinels = [f"<extra_id_{i}>" for i in reversed(range(extra))]
        # Only the ids that exist in the model: sentinels are never produced from a protein anyway.
        if not set(sentinels) & set(pieces) and len(pieces) + extra <= config.vocab_size:
            pieces += sentinels
    return pieces


def nemo_vocabulary(checkpoint: Checkpoint) -> tuple[list[str], int]:
    """(pieces in id order, how many were added) of a ProtT5nv archive: its SentencePiece artifact
    (`tokenizer.model`, else `tokenizer.vocab_file`) extended as NeMo's Megatron T5 extends it:
    `<cls>`, `<sep>` (and any of `<mask>` `<pad>` `<s>` `</s>` missing), then
    `tokenizer.num_sentinel_tokens` sentinels `<extra_id_0>`... (96 for ProtT5nv). Archives store
    the artifact before that extension, so the sentinels are usually absent: they get the ids NeMo
    gives them (32..127 after ESM-1nv's 30 pieces); pieces already present keep their ids."""
    tokenizer = checkpoint.config.get("tokenizer") or {}
    pieces = list(sentencepiece_pieces(checkpoint, "ProtT5nv"))
    count = len(pieces)
    sentinels = int(tokenizer.get("num_sentinel_tokens", NEMO_SENTINELS) or 0)
    for token in (*NEMO_ADDED, *(f"<extra_id_{i}>" for i in range(sentinels))):
        if token not in pieces:
            pieces.append(token)
    return pieces, len(pieces) - count


def sentencepiece_model(pieces: list[str], *, unk: str, pad: str | None = None, bos: str | None = None,
                        eos: str | None = None, control: tuple[str, ...] = ()) -> bytes:
    """A SentencePiece `.model` (unigram ModelProto) holding exactly `pieces`, in id order: `unk`
    typed UNKNOWN, `pad` / `bos` / `eos` / `control` CONTROL, the others NORMAL with decreasing
    scores (so the longest-match encoding is one piece per residue). Written without the
    sentencepiece library (protobuf wire format, as sentencepiece_vocab.py reads it)."""
    specials = {token for token in (pad, bos, eos, *control) if token is not None}
    body = b""
    for index, piece in enumerate(pieces):
        kind = 2 if piece == unk else 3 if piece in specials else 1
        score = 0.0 if kind != 1 else -float(index)
        body += _field(1, 2, _field(1, 2, piece.encode("utf-8")) + _field(2, 5, struct.pack("<f", score))
                       + _field(3, 0, _varint(kind)))

    def index_of(token: str | None) -> int:
        return -1 if token is None else pieces.index(token)

    trainer = (_field(3, 0, _varint(1)) + _field(4, 0, _varint(len(pieces)))  # UNIGRAM, vocab_size
               + _field(40, 0, _varint(index_of(unk))) + _field(41, 0, _varint(index_of(bos)))
               + _field(42, 0, _varint(index_of(eos))) + _field(43, 0, _varint(index_of(pad))))
    # identity normalization; add_dummy_prefix, remove_extra_whitespaces, escape_whitespaces
    normalizer = (_field(1, 2, b"identity") + _field(3, 0, _varint(1)) + _field(4, 0, _varint(1))
                  + _field(5, 0, _varint(1)))
    return body + _field(2, 2, trainer) + _field(3, 2, normalizer)


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32 values are written as 10-byte two's complement
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    key = _varint(number << 3 | wire)
    return key + (_varint(len(payload)) + payload if wire == 2 else payload)
