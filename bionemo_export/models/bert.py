"""BERT protein language models (AntiBERTy, ProtBert) from a Hugging Face directory, read into
`BertModel`. The real AntiBERTy ships inside the `antiberty==0.1.3` wheel (see antiberty_checkpoint).
"""

from __future__ import annotations

import importlib.util
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

SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "bos": "[CLS]", "eos": "[SEP]"}
RARE_RESIDUES = "UZOB"
"""Mapped to X when the vocabulary has X, as ProtBert's authors prescribe."""
ANTIBERTY_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"ACDEFGHIKLMNPQRSTVWY"]


@register
class BertFamily(HuggingFaceEncoderFamily):
    name = "bert"
    description = "BERT protein language models (AntiBERTy, ProtBert), Hugging Face BertModel"
    model_type = "bert"
    config_class = transformers.BertConfig
    backbone_class = transformers.BertModel
    key_prefix = "bert."
    unused_prefixes = ("pooler.", "cls.", "classifier.")

    def build_tokenizer(self, checkpoint: Path, config: Any, max_length: int | None) -> CharacterTokenizer:
        vocab_file = _find_vocab(checkpoint)
        vocab = read_vocab(vocab_file)
        missing = [token for token in SPECIAL_TOKENS.values() if token not in vocab]
        if missing:
            raise ValueError(f"{vocab_file} lacks the special tokens {missing}")
        residues = "".join(t for t in vocab if len(t) == 1 and t.isascii() and t.isalpha())
        if not residues:
            raise ValueError(f"{vocab_file} has no single-letter residue tokens")
        aliases = {}
        if "X" in vocab:
            aliases = {rare: "X" for rare in RARE_RESIDUES}
            residues += "".join(rare for rare in RARE_RESIDUES if rare not in residues)
        return CharacterTokenizer(
            vocab,
            residues=residues,
            pad_token=SPECIAL_TOKENS["pad"],
            bos_token=SPECIAL_TOKENS["bos"],
            eos_token=SPECIAL_TOKENS["eos"],
            unk_token=SPECIAL_TOKENS["unk"],
            max_length=token_limit(config.max_position_embeddings, max_length, "this BERT model"),
            aliases=aliases,
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
        # AntiBERTy's configuration and vocabulary layout, at a small size.
        config = transformers.BertConfig(
            vocab_size=len(ANTIBERTY_VOCAB),
            pad_token_id=ANTIBERTY_VOCAB.index("[PAD]"),
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            intermediate_size=intermediate_size,
            max_position_embeddings=512,
            type_vocab_size=2,
            layer_norm_eps=1e-12,
        )
        return save_random_model(
            lambda: transformers.BertForMaskedLM(config), out, seed=seed, vocab=ANTIBERTY_VOCAB
        )

    def sample_sequences(self) -> list[str]:
        # Antibody variable-domain fragments: trastuzumab VH/VL, a CDR-H3, human germline starts.
        return [
            "EVQLV",
            "SRWGGDGFYAMDY",
            "EIVLTQSPGTLSLSPGERATLSC",
            "QVQLVQSGAEVKKPGASVKVSCKASGYTFT",
            "DIQMTQSPSSLSASVGDRVTITCRASQDVNTAVAWYQQKPGKAPKLLIYSASFLYSGVPSRFSGSRSGTDFTLTISSLQPEDFA"
            "TYYCQQHYTTPPTFGQGTKVEIK",
            "EVQLVESGGGLVQPGGSLRLSCAASGFNIKDTYIHWVRQAPGKGLEWVARIYPTNGYTRYADSVKGRFTISADTSKNTAYLQMNS"
            "LRAEDTAVYYCSRWGGDGFYAMDYWGQGTLVTVSS",
        ]


def _find_vocab(checkpoint: Path) -> Path:
    """vocab.txt in the checkpoint folder or its parent (where the antiberty wheel keeps it)."""
    for folder in (checkpoint, checkpoint.parent):
        if (folder / "vocab.txt").is_file():
            return folder / "vocab.txt"
    raise ValueError(f"no vocab.txt in {checkpoint} or its parent folder")


def antiberty_checkpoint() -> Path:
    """The real AntiBERTy model folder inside the installed antiberty package.

    Located without importing antiberty: its own classes fail under transformers 5.x, and only
    version 0.1.3 ships the weights (newer ones download them from a hub).
    """
    spec = importlib.util.find_spec("antiberty")  # finds the package without running it
    locations = spec.submodule_search_locations if spec and spec.submodule_search_locations else []
    for location in locations:
        folder = Path(location) / "trained_models" / "AntiBERTy_md_smooth"
        if (folder / "config.json").is_file():
            return folder
    raise FileNotFoundError(
        "the AntiBERTy weights are not installed: pip install antiberty==0.1.3 "
        "(the only version whose wheel ships them)"
    )
