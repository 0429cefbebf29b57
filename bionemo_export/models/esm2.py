"""ESM-2 (rotary positions, pre-LN) from a Hugging Face directory, read into `EsmModel`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import transformers

from bionemo_export.models.base import register
from bionemo_export.models.encoder import (
    HuggingFaceEncoderFamily,
    read_vocab,
    save_random_model,
    token_limit,
)
from bionemo_export.tokenizers.character import CharacterTokenizer

RESIDUES = "LAGVSERTIDPKQNFYMHWCXBUZO"
ALPHABET = ["<cls>", "<pad>", "<eos>", "<unk>", *RESIDUES, ".", "-", "<null_1>", "<mask>"]
"""The 33 ESM-2 token ids, in order (shared/reference/bionemo-serving.md)."""
MAX_TOKENS = 1024
"""ESM-2's length limit: <cls> + 1022 residues + <eos>."""


@register
class Esm2Family(HuggingFaceEncoderFamily):
    name = "esm2"
    description = "ESM-2 protein language model (rotary positions, pre-LN), Hugging Face EsmModel"
    model_type = "esm"
    config_class = transformers.EsmConfig
    backbone_class = transformers.EsmModel
    key_prefix = "esm."
    unused_prefixes = ("lm_head.", "contact_head.")

    def build_tokenizer(self, checkpoint: Path, config: Any, max_length: int | None) -> CharacterTokenizer:
        vocab_file = checkpoint / "vocab.txt"
        if vocab_file.is_file():
            _check_alphabet(vocab_file)
        return CharacterTokenizer(
            ALPHABET,
            residues=RESIDUES,
            pad_token="<pad>",
            bos_token="<cls>",
            eos_token="<eos>",
            unk_token="<unk>",
            max_length=token_limit(MAX_TOKENS, max_length, "ESM-2"),
        )

    def save_random_checkpoint(
        self,
        out: Path,
        *,
        seed: int = 0,
        hidden_size: int = 32,
        num_layers: int = 2,
        num_heads: int = 4,
        intermediate_size: int = 64,
    ) -> Path:
        # The settings of the released ESM-2 configs, at a small size.
        config = transformers.EsmConfig(
            vocab_size=len(ALPHABET),
            pad_token_id=ALPHABET.index("<pad>"),
            mask_token_id=ALPHABET.index("<mask>"),
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            intermediate_size=intermediate_size,
            position_embedding_type="rotary",
            max_position_embeddings=MAX_TOKENS + 2,
            token_dropout=True,
            emb_layer_norm_before=False,
            layer_norm_eps=1e-5,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return save_random_model(
            lambda: transformers.EsmForMaskedLM(config), out, seed=seed, vocab=ALPHABET
        )

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


def _check_alphabet(vocab_file: Path) -> None:
    """A checkpoint's vocab.txt must be the ESM-2 alphabet, or its token ids would be wrong."""
    vocab = read_vocab(vocab_file)
    if vocab == ALPHABET:
        return
    for line, (got, want) in enumerate(zip(vocab, ALPHABET), start=1):
        if got != want:
            raise ValueError(
                f"{vocab_file} is not the ESM-2 alphabet: line {line} is {got!r}, expected {want!r}"
            )
    raise ValueError(
        f"{vocab_file} has {len(vocab)} tokens; the ESM-2 alphabet has {len(ALPHABET)}"
    )
